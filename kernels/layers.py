"""Which modules a compressed-tensors checkpoint quantizes, decided once for QAT and requantize.

The served checkpoint targets every `nn.Linear` ("Linear" in config.json) and ignores the output
embedding (lm_head) and the layers the caller keeps in full precision; embeddings are not Linear.
vLLM fuses q/k/v into qkv_proj and gate/up into gate_up_proj and refuses a fused layer whose
shards disagree, so a full-precision set must hold all shards of a fused group or none.
"""

from torch import nn

FUSED_SHARDS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def output_embedding_names(model: nn.Module) -> set[str]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {n for n, m in model.named_modules() if head is not None and m is head}
    return names | {n for n, _ in model.named_modules() if n == "lm_head" or n.endswith(".lm_head")}


def linear_names(model: nn.Module) -> list[str]:
    """Every nn.Linear except the output embedding, in module order."""
    skip = output_embedding_names(model)
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in skip]


def check_fused(full_precision: set[str], names: list[str]) -> None:
    present = set(names)
    for name in names:
        parent, _, leaf = name.rpartition(".")
        for group in FUSED_SHARDS:
            if leaf != group[0]:
                continue
            shards = [f"{parent}.{s}" if parent else s for s in group]
            shards = [s for s in shards if s in present]
            kept = [s in full_precision for s in shards]
            if any(kept) and not all(kept):
                raise ValueError(f"full_precision must hold all or none of the fused shards {shards} "
                                 "(vLLM fuses them into one layer)")


def quant_targets(model: nn.Module, full_precision: tuple[str, ...] | list[str] | set[str] = ()
                  ) -> list[str]:
    """Names of the linear layers to quantize: all but lm_head and `full_precision`."""
    names = linear_names(model)
    keep = set(full_precision)
    unknown = keep - set(names)
    if unknown:
        raise ValueError(f"full_precision names no quantizable linear layer: {sorted(unknown)}")
    check_fused(keep, names)
    return [n for n in names if n not in keep]


def ignore_list(model: nn.Module, targets: list[str]) -> list[str]:
    """The config.json `ignore` entries: the output embedding and every non-target Linear."""
    head = sorted(output_embedding_names(model) & {n for n, m in model.named_modules()
                                                  if isinstance(m, nn.Linear)})
    rest = [n for n in linear_names(model) if n not in set(targets)]
    return head + rest
