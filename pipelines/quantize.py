"""Quantize-and-save: a Hugging Face safetensors folder (or a QAT-converted model) -> a
compressed-tensors checkpoint that vLLM loads natively, plus its manifest.

The checkpoint is what compressed-tensors 0.17 itself writes: config.json gains a
`quantization_config` built from compressed-tensors' own QuantizationConfig (quant_method
"compressed-tensors", one config group targeting "Linear", format `pack-quantized` for W4A16 or
`int-quantized` for W8A8, status "compressed", `ignore` = lm_head + the full-precision layers),
and each quantized layer's weight is replaced by the tensors in kernels/ct_format.py. Everything
else (embeddings, norms, biases, lm_head) is copied unchanged, shard by shard, with tokenizer and
generation files. Which layers are quantized is kernels.quant_targets, the same rule QAT uses.

Invariants: the output appears atomically (written to a temporary sibling, then renamed); the
manifest (QuantizedCheckpoint, also written as flywheel_manifest.json) records the spec, the layer
plan, the sha256 of every file and the parent; quantizing the latent weights of a QAT model gives
bit for bit the tensors its `convert` step holds.
"""

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import compressed_tensors
import torch
from compressed_tensors.base import (COMPRESSION_VERSION_NAME, QUANTIZATION_CONFIG_NAME,
                                     QUANTIZATION_METHOD, QUANTIZATION_METHOD_NAME,
                                     SPARSITY_CONFIG_NAME, TRANSFORM_CONFIG_NAME)
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from kernels import QuantizedLinear, QuantSpec, compress_weight, quant_targets
from kernels.layers import check_fused, ignore_list, linear_names
from rollout.artifacts import MANIFEST, file_sha256

MANIFEST_NAME = MANIFEST  # the one artifact manifest name; the parent's is never copied
SCHEMA_VERSION = 1
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_NOT_COPIED = ("config.json", "model.safetensors.index.json", MANIFEST_NAME)


@dataclass(frozen=True)
class QuantizedCheckpoint:
    path: str
    spec: QuantSpec
    format: str                          # compressed-tensors format in config.json
    quantized_layers: tuple[str, ...]    # module names, in model order
    ignored_layers: tuple[str, ...]      # config.json `ignore`: lm_head + full-precision linears
    files: tuple[tuple[str, str], ...]   # (path relative to `path`, sha256), sorted
    parent: str | None                   # what it was made from (source folder or version)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        d = asdict(self)
        d["spec"] = self.spec.to_dict()
        d["files"] = dict(self.files)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "QuantizedCheckpoint":
        d = dict(d)
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"schema_version must be {SCHEMA_VERSION}, got {d.get('schema_version')!r}")
        return cls(**d | {"spec": QuantSpec.from_dict(d["spec"]), "files": tuple(sorted(d["files"].items())),
                          "quantized_layers": tuple(d["quantized_layers"]),
                          "ignored_layers": tuple(d["ignored_layers"])})


def load_manifest(path: str | Path) -> QuantizedCheckpoint:
    return QuantizedCheckpoint.from_dict(json.loads((Path(path) / MANIFEST_NAME).read_text()))


def quantization_config(spec: QuantSpec, ignore: list[str]) -> dict:
    """The config.json `quantization_config` entry, as compressed-tensors' ModelCompressor writes it."""
    weights = QuantizationArgs(num_bits=spec.weight_bits, type="int", symmetric=spec.symmetric,
                               strategy=spec.granularity, group_size=spec.group_size, dynamic=False,
                               scale_dtype=spec.scale_dtype and getattr(torch, spec.scale_dtype))
    acts = None
    if spec.activations == "int8_dynamic_token":
        acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts, format=spec.format)
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=spec.format,
                                quantization_status="compressed", ignore=list(ignore))
    return {COMPRESSION_VERSION_NAME: compressed_tensors.__version__,
            QUANTIZATION_METHOD_NAME: QUANTIZATION_METHOD, SPARSITY_CONFIG_NAME: {},
            TRANSFORM_CONFIG_NAME: {}, **config.model_dump(exclude=["quant_method"])}


def _staging(dst: Path, overwrite: bool) -> Path:
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} exists (pass overwrite=True to replace it)")
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _copy_side_files(src: Path, tmp: Path) -> None:
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in _NOT_COPIED and not f.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(f, tmp / f.name)


def _finish(tmp: Path, dst: Path, config: dict, spec: QuantSpec, quantized: list[str],
            ignore: list[str], parent: str | None) -> QuantizedCheckpoint:
    config[QUANTIZATION_CONFIG_NAME] = quantization_config(spec, ignore)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    files = tuple(sorted((p.relative_to(tmp).as_posix(), file_sha256(p)) for p in tmp.rglob("*") if p.is_file()))
    manifest = QuantizedCheckpoint(str(dst.resolve()), spec, spec.format, tuple(quantized), tuple(ignore), files, parent)
    (tmp / MANIFEST_NAME).write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    old = dst.parent / f".{dst.name}.old-{os.getpid()}"
    if dst.exists():
        dst.rename(old)
    tmp.rename(dst)
    shutil.rmtree(old, ignore_errors=True)
    return manifest


def _meta_model(config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def quantize_checkpoint(src: str | Path, dst: str | Path, spec: QuantSpec, *,
                        full_precision: tuple[str, ...] | list[str] = (), parent: str | None = None,
                        impl: str | None = None, overwrite: bool = False,
                        extra_files: dict[str, str] | None = None) -> QuantizedCheckpoint:
    """HF safetensors folder `src` -> compressed-tensors folder `dst`. `full_precision`: linear
    layer names to keep unquantized (all shards of a fused q/k/v or gate/up group, or none).
    `extra_files`: {name: text} written into `dst` too (hashed in its manifest, like the rest)."""
    from transformers import AutoConfig

    src, dst = Path(src), Path(dst)
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"src holds no *.safetensors files: {src}")
    model = _meta_model(AutoConfig.from_pretrained(src))
    targets = quant_targets(model, full_precision)
    tmp = _staging(dst, overwrite)
    try:
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        return _requantize(src, tmp, dst, shards, model, targets, spec, impl, parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _requantize(src: Path, tmp: Path, dst: Path, shards: list[Path], model: nn.Module, targets: list[str],
                spec: QuantSpec, impl: str | None, parent: str | None) -> QuantizedCheckpoint:
    pending, weight_map, total = set(targets), {}, 0
    for shard in shards:
        out = {}
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():
                module, _, leaf = key.rpartition(".")
                if leaf == "weight" and module in pending:
                    pending.discard(module)
                    for name, t in compress_weight(f.get_tensor(key), spec, impl).items():
                        out[f"{module}.{name}"] = t
                else:
                    out[key] = f.get_tensor(key)
        save_file(out, tmp / shard.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, shard.name))
        total += sum(t.numel() * t.element_size() for t in out.values())
    if pending:
        raise ValueError(f"no weight tensor found in {src} for layers {sorted(pending)}")
    if (src / "model.safetensors.index.json").exists():
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    _copy_side_files(src, tmp)
    config = json.loads((src / "config.json").read_text())
    return _finish(tmp, dst, config, spec, targets, ignore_list(model, targets),
                   parent if parent is not None else str(src))


def save_quantized(model: nn.Module, dst: str | Path, spec: QuantSpec, *,
                   tokenizer_from: str | Path | None = None, parent: str | None = None,
                   overwrite: bool = False) -> QuantizedCheckpoint:
    """A model converted by trainers.qat.quantize_(..., step="convert") -> compressed-tensors
    folder `dst`. Its QuantizedLinear buffers are written as they are (no requantization);
    linear layers left as nn.Linear are listed as full precision."""
    dst = Path(dst)
    quantized = [n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    if not quantized:
        raise ValueError("model holds no QuantizedLinear layers: run quantize_(model, spec, step='convert')")
    for name in quantized:
        if model.get_submodule(name).spec != spec:
            raise ValueError(f"spec differs from the one {name} was converted with")
    unconverted = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and hasattr(m, "spec")]
    if unconverted:
        raise ValueError(f"layers still prepared for QAT (convert first): {unconverted[:3]}")
    plain = linear_names(model)
    check_fused(set(plain), plain + quantized)
    state, seen = {}, set()
    for key, t in model.state_dict().items():
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if ident in seen:  # a tied duplicate (lm_head = embed_tokens): HF keeps the first name
            continue
        seen.add(ident)
        state[key] = t.detach().contiguous().cpu()
    config = json.loads(model.config.to_json_string(use_diff=False))
    config["architectures"] = config.get("architectures") or [type(model).__name__]  # vLLM needs it
    tmp = _staging(dst, overwrite)
    try:
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        if tokenizer_from is not None:
            _copy_side_files(Path(tokenizer_from), tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        return _finish(tmp, dst, config, spec, quantized, ignore_list(model, quantized), parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
