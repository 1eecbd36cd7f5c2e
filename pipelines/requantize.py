"""Requantize: a trained checkpoint (latent full-precision weights) -> the serving checkpoint, with
a layer plan chosen by searching whole plans.

    calibration slice (train split, never held out) ─▶ fp log-probs (once)
    plans (which layers stay full precision, within the budget) ─▶ one batched forward each ─▶ KL(fp || plan)
    best plan ─▶ pipelines.quantize.quantize_checkpoint(full_precision=plan) + layer_plan.json

A *unit* is what can stay in full precision on its own: a linear layer, or all shards of a group
vLLM fuses (q/k/v, gate/up). Quantization errors of different units interact (they can cancel),
so plans are scored jointly: the search starts from every unit quantized, adds units greedily by
the KL of the whole plan, then refines by swaps and removals until no move lowers the KL, drawing
units from the baseline's most sensitive ones (`joint_candidates`: the plans it scores then stop
growing with the model's depth; the baseline still scores each unit once). The baseline is the usual one: rank units by their own sensitivity (the KL with only that unit
quantized) and keep the most sensitive ones in full precision. The search fits its slice's noise
(the per-token KL is heavy-tailed), so the joint plan and the baseline are then compared on a second,
disjoint slice, and the lower one is chosen. Both searches' curves, every plan they scored and that
choice go into the plan (an artifact; the loop logs it to MLflow).
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from kernels import QuantSpec, compress_weight, fake_quant, fake_quant_act, weight_qparams
from kernels.layers import FUSED_SHARDS, linear_names
from pipelines.logits import Sequences, kl, model_logprobs

PLAN_FILE = "layer_plan.json"


@dataclass
class RequantizeConfig:
    max_full_precision_layers: int = 4  # linear layers left unquantized (a fused group counts each shard)
    max_extra_bytes: int | None = None  # bytes the full-precision layers may add over a fully quantized model
    calibration_sequences: int = 16  # episodes of the train split the plans are scored on
    # Train episodes after the calibration ones on which the joint plan and the baseline are scored
    # again, the lower chosen; 0: the joint plan as searched. Measured over the 7 checkpoints of a
    # default run, on the next cycle's traffic, at 4 layers: the joint plan searched on 16 episodes
    # had 1.12x the baseline's KL (geometric mean; up to 1.95x), the one chosen on 32 more 0.97x
    # (at most 1.07x).
    selection_sequences: int = 32
    search: str = "joint"  # "joint" | "one_at_a_time" (the baseline, for comparison)
    max_evals: int = 200  # plans scored by the joint search at most (one forward each)
    # Units the joint search may add or swap in: the most sensitive ones by the baseline's own
    # measure (plus the baseline's plan); None: every unit. Each greedy step and each round of
    # swaps scores one plan per candidate, so this keeps the joint search's plans from growing with
    # the model's depth: the default model has 16 units (all candidates), a 10-layer one 40.
    joint_candidates: int | None = 16
    # The plan the server runs now is kept when its KL is within this factor of the chosen plan's:
    # the swap then reloads weights in place instead of warming a second engine (~25 s on these
    # CPUs, bench/gate_path.py). Measured in the default loop: the serving plan's KL was 1.5-2.7x
    # the best's, at most 2.5e-3 nats per token, 8x under the gate's max_quant_kl_mean.
    # None: always the searched plan.
    keep_serving_plan_within: float | None = 3.0

    def __post_init__(self):
        if self.max_full_precision_layers < 0:
            raise ValueError(f"max_full_precision_layers must be >= 0, got {self.max_full_precision_layers}")
        if self.max_extra_bytes is not None and self.max_extra_bytes < 0:
            raise ValueError(f"max_extra_bytes must be >= 0 or null, got {self.max_extra_bytes}")
        if self.calibration_sequences < 1:
            raise ValueError(f"calibration_sequences must be >= 1, got {self.calibration_sequences}")
        if self.selection_sequences < 0:
            raise ValueError(f"selection_sequences must be >= 0, got {self.selection_sequences}")
        if self.search not in ("joint", "one_at_a_time"):
            raise ValueError(f"search must be 'joint' or 'one_at_a_time', got {self.search!r}")
        if self.joint_candidates is not None and self.joint_candidates < 1:
            raise ValueError(f"joint_candidates must be >= 1 or null, got {self.joint_candidates!r}")
        if self.keep_serving_plan_within is not None and not self.keep_serving_plan_within >= 1:
            raise ValueError(f"keep_serving_plan_within must be >= 1 or null, got {self.keep_serving_plan_within!r}")


@dataclass(frozen=True)
class Unit:
    layers: tuple[str, ...]
    extra_bytes: int  # full precision minus quantized, in the checkpoint


@dataclass
class LayerPlan:
    full_precision: list[str]  # layer names kept unquantized
    kl: float  # mean per-token KL(fp || plan) on the calibration slice
    search: str
    joint: dict  # {"plan": [...], "kl": x, "curve": [[layers, kl], ...]}
    one_at_a_time: dict  # same, plus "sensitivity": {unit: kl}
    evaluated: list[dict] = field(default_factory=list)  # every plan scored: {"full_precision", "layers", "kl"}
    more_quantized_lower_kl: list[dict] = field(default_factory=list)  # quantizing one more unit lowered KL
    calibration: dict = field(default_factory=dict)  # source, sequences, scored tokens
    budget: dict = field(default_factory=dict)
    serving_plan: dict = field(default_factory=dict)  # {"plan", "kl", "kept"}: the server's plan, scored
    selection: dict = field(default_factory=dict)  # joint vs baseline on the second slice, and which was chosen
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class _Switch(nn.Module):
    """A linear layer that computes with its full-precision or its fake-quantized weight."""

    def __init__(self, linear: nn.Linear, spec: QuantSpec):
        super().__init__()
        self.weight, self.bias, self.spec = linear.weight, linear.bias, spec
        scale, zp = weight_qparams(linear.weight.detach(), spec)
        self.fq_weight = fake_quant(linear.weight.detach(), scale, zp, spec)
        self.quantized = True

    def forward(self, x):
        if not self.quantized:
            return F.linear(x, self.weight, self.bias)
        if self.spec.activations == "int8_dynamic_token":
            x = fake_quant_act(x, self.spec)
        return F.linear(x, self.fq_weight, self.bias)


def units_of(model: nn.Module, spec: QuantSpec) -> list[Unit]:
    names = linear_names(model)
    present, units = set(names), []
    for name in names:
        parent, _, leaf = name.rpartition(".")
        group = next((g for g in FUSED_SHARDS if leaf in g), (leaf,))
        if leaf != group[0] and f"{parent}.{group[0]}" in present:
            continue  # a later shard: its unit starts at the first
        layers = tuple(f"{parent}.{s}" if parent else s for s in group if (f"{parent}.{s}" if parent else s) in present)
        extra = 0
        for n in layers:
            w = model.get_submodule(n).weight
            packed = sum(t.numel() * t.element_size() for t in compress_weight(w.detach(), spec).values())
            extra += w.numel() * w.element_size() - packed
        units.append(Unit(layers, extra))
    return units


class PlanScorer:
    """KL(fp || plan) of whole plans, one batched forward each, memoized by plan. A decoder
    layer's output depends only on the plan's units up to that layer, so it is cached under that
    part of the plan: a plan that differs from a scored one in layer l recomputes layers l.. only."""

    def __init__(self, model: nn.Module, spec: QuantSpec, seqs: Sequences, batch_size: int = 64,
                 cache_entries: int = 96):
        self.model, self.seqs, self.batch_size = model.eval(), seqs, batch_size
        self.units = units_of(model, spec)
        with torch.no_grad():
            self.reference = model_logprobs(model, seqs, batch_size)
        for unit in self.units:
            for name in unit.layers:
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, leaf, _Switch(model.get_submodule(name), spec))
        self.scores: dict[frozenset[int], float] = {}
        self._plan: frozenset[int] = frozenset()
        self._cache: dict[tuple, object] = {}
        self._cache_entries, self._batch = cache_entries, 0
        blocks = _decoder_layers(model)
        self._depth = [next((d for d, b in enumerate(blocks) if u.layers[0].startswith(b + ".")), len(blocks))
                       for u in self.units]
        for d, name in enumerate(blocks):
            self._wrap(model.get_submodule(name), d)

    def _wrap(self, block: nn.Module, depth: int) -> None:
        inner = block.forward

        def forward(*args, **kwargs):
            key = (self._batch, depth, frozenset(u for u in self._plan if self._depth[u] <= depth))
            if key not in self._cache:
                if len(self._cache) >= self._cache_entries:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[key] = inner(*args, **kwargs)
            return self._cache[key]

        block.forward = forward

    def __call__(self, plan: frozenset[int]) -> float:
        if plan not in self.scores:
            self.scores[plan] = self.per_token(plan).mean().item()
        return self.scores[plan]

    def per_token(self, plan: frozenset[int]) -> torch.Tensor:
        """[num_scored] KL(fp || plan) at each scored position (not memoized)."""
        for i, unit in enumerate(self.units):
            for name in unit.layers:
                self.model.get_submodule(name).quantized = i not in plan
        self._plan, rows = plan, []
        with torch.no_grad():
            for self._batch, batch in enumerate(_one_batch_each(self.seqs, self.batch_size)):
                rows.append(model_logprobs(self.model, batch, self.batch_size))
        return kl(self.reference, torch.cat(rows))

    def layers(self, plan) -> list[str]:
        return [n for i in sorted(plan) for n in self.units[i].layers]


def _decoder_layers(model: nn.Module) -> list[str]:
    """Names of the repeated decoder blocks (the ModuleList holding the linear layers)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) and any(isinstance(x, nn.Linear) for x in m[0].modules()):
            return [f"{name}.{i}" for i in range(len(m))]
    return []


def _one_batch_each(seqs: Sequences, batch_size: int):
    for i in range(0, len(seqs.ids), batch_size):
        yield Sequences(seqs.ids[i:i + batch_size], seqs.sampled[i:i + batch_size], seqs.source)


def _feasible(scorer: PlanScorer, plan, cfg: RequantizeConfig) -> bool:
    n = sum(len(scorer.units[i].layers) for i in plan)
    extra = sum(scorer.units[i].extra_bytes for i in plan)
    return n <= cfg.max_full_precision_layers and (cfg.max_extra_bytes is None or extra <= cfg.max_extra_bytes)


def one_at_a_time(scorer: PlanScorer, cfg: RequantizeConfig) -> dict:
    """The baseline: each unit's own sensitivity (only it quantized), the most sensitive kept."""
    everything = frozenset(range(len(scorer.units)))
    sens = {i: scorer(everything - {i}) for i in range(len(scorer.units))}
    plan, curve = frozenset(), [[0, scorer(frozenset())]]
    for i in sorted(sens, key=sens.get, reverse=True):
        if _feasible(scorer, plan | {i}, cfg):
            plan = plan | {i}
            curve.append([len(scorer.layers(plan)), scorer(plan)])
    return {"plan": scorer.layers(plan), "kl": scorer(plan), "curve": curve, "units": sorted(plan),
            "sensitivity": {"+".join(scorer.units[i].layers): v for i, v in sens.items()},
            "ranked": sorted(sens, key=sens.get, reverse=True)}


def joint(scorer: PlanScorer, cfg: RequantizeConfig, start: frozenset[int] = frozenset(),
          candidates: list[int] | None = None) -> dict:
    """Greedy additions by whole-plan KL, then swaps and removals while any lowers it; the best
    plan seen (which may keep fewer layers than the budget allows) is the answer. Units are drawn
    from `candidates` (and `start`); None: all."""
    pool = sorted(set(range(len(scorer.units)) if candidates is None else candidates) | start)
    plan, curve, best = frozenset(), [[0, scorer(frozenset())]], frozenset()
    while len(scorer.scores) < cfg.max_evals:
        moves = [plan | {u} for u in pool if u not in plan and _feasible(scorer, plan | {u}, cfg)]
        if not moves:
            break
        plan = min(moves, key=scorer)
        curve.append([len(scorer.layers(plan)), scorer(plan)])
        best = min(best, plan, key=scorer)
    best = min(best, start, key=scorer)  # the baseline's plan, when given, is a starting point too
    improved = True
    while improved and len(scorer.scores) < cfg.max_evals:
        improved = False
        moves = [best - {u} for u in best] + [best - {u} | {v} for u in best for v in pool if v not in best]
        moves += [best | {v} for v in pool if v not in best]
        for cand in (m for m in moves if _feasible(scorer, m, cfg)):
            if len(scorer.scores) >= cfg.max_evals:
                break
            if scorer(cand) < scorer(best):
                best, improved = cand, True
    return {"plan": scorer.layers(best), "kl": scorer(best), "curve": curve, "units": sorted(best),
            "candidates": len(pool)}


def _cancellations(scorer: PlanScorer) -> list[dict]:
    """Scored pairs where quantizing one more unit lowered the KL of the whole plan."""
    out = []
    for plan, v in scorer.scores.items():
        for u in plan:
            smaller = plan - {u}
            if smaller in scorer.scores and scorer.scores[smaller] < v:
                out.append({"full_precision": scorer.layers(plan), "also_quantized": list(scorer.units[u].layers),
                            "kl_before": v, "kl_after": scorer.scores[smaller]})
    return sorted(out, key=lambda d: d["kl_after"] - d["kl_before"])[:20]


def select(scorer: PlanScorer, joint_: dict, base: dict) -> dict:
    """The joint plan and the baseline scored on `scorer`'s slice (not the one searched on): the
    lower is chosen, a tie going to the joint plan."""
    kj, kb = scorer(frozenset(joint_["units"])), scorer(frozenset(base["units"]))
    return {"source": scorer.seqs.source, "sequences": len(scorer.seqs.ids), "scored_tokens": scorer.seqs.num_scored,
            "joint_kl": kj, "one_at_a_time_kl": kb, "chosen": "joint" if not kb < kj else "one_at_a_time"}


def _as_units(scorer: PlanScorer, layers) -> frozenset[int] | None:
    """The units covering exactly `layers` (names outside the units, like lm_head, ignored), or
    None when a unit is only partly in it."""
    names = set(layers)
    plan = frozenset(i for i, u in enumerate(scorer.units) if names & set(u.layers))
    if any(not set(scorer.units[i].layers) <= names for i in plan):
        return None
    return plan


def search_plan(model: nn.Module, spec: QuantSpec, seqs: Sequences, cfg: RequantizeConfig,
                serving: tuple[str, ...] | None = None, selection: Sequences | None = None) -> LayerPlan:
    """Both searches on `model` (modified in place: pass a throwaway copy) over `seqs`; with
    `selection` (other episodes), the joint plan or the baseline, whichever is lower there.
    `serving`: the layers the server's checkpoint keeps in full precision; kept when good enough
    (keep_serving_plan_within)."""
    t0 = time.perf_counter()
    choose = selection is not None and len(selection.ids) > 0 and cfg.search == "joint"
    spare = copy.deepcopy(model) if choose else None
    scorer = PlanScorer(model, spec, seqs)
    if not any(_feasible(scorer, {i}, cfg) for i in range(len(scorer.units))):  # nothing may stay: no search
        only = {"plan": [], "kl": scorer(frozenset()), "curve": [[0, scorer(frozenset())]], "units": []}
        base, joint_ = {**only, "sensitivity": {}}, only
    else:
        base = one_at_a_time(scorer, cfg)
        top = base["ranked"][:cfg.joint_candidates] if cfg.joint_candidates is not None else None
        joint_ = joint(scorer, cfg, start=frozenset(base["units"]), candidates=top)
    chosen, picked = (joint_ if cfg.search == "joint" else base), {}
    if spare is not None and joint_["units"] != base["units"]:
        picked = select(PlanScorer(spare, spec, selection), joint_, base)
        chosen = joint_ if picked["chosen"] == "joint" else base
    kept = {}
    if serving is not None and (units := _as_units(scorer, serving)) is not None and _feasible(scorer, units, cfg):
        kept = {"plan": scorer.layers(units), "kl": scorer(units), "kept": False}
        if cfg.keep_serving_plan_within is not None and kept["kl"] <= chosen["kl"] * cfg.keep_serving_plan_within:
            kept["kept"] = True
            chosen = {**kept, "units": sorted(units)}
    evaluated = [{"full_precision": scorer.layers(p), "layers": len(scorer.layers(p)), "kl": v}
                 for p, v in sorted(scorer.scores.items(), key=lambda kv: kv[1])]
    return LayerPlan(
        full_precision=chosen["plan"], kl=chosen["kl"], search=cfg.search, joint=joint_, one_at_a_time=base,
        evaluated=evaluated, more_quantized_lower_kl=_cancellations(scorer),
        calibration={"source": seqs.source, "sequences": len(seqs.ids), "scored_tokens": seqs.num_scored},
        budget={"max_full_precision_layers": cfg.max_full_precision_layers, "max_extra_bytes": cfg.max_extra_bytes,
                "units": len(scorer.units)}, serving_plan=kept, selection=picked,
        seconds=round(time.perf_counter() - t0, 3))


def requantize(src: str | Path, dst: str | Path, spec: QuantSpec, seqs: Sequences, cfg: RequantizeConfig,
               parent: str | None = None, overwrite: bool = False, serving: tuple[str, ...] | None = None,
               selection: Sequences | None = None):
    """Trained HF folder `src` -> compressed-tensors folder `dst` quantized by the searched plan
    (or `serving`'s; `selection` picks between the joint plan and the baseline, see search_plan),
    the plan written into it as layer_plan.json (hashed in its manifest). Returns (manifest, plan)."""
    from transformers import AutoModelForCausalLM

    from pipelines.quantize import quantize_checkpoint

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    plan = search_plan(model, spec, seqs, cfg, serving, selection)
    manifest = quantize_checkpoint(src, dst, spec, full_precision=plan.full_precision,
                                   parent=parent if parent is not None else str(Path(src).resolve()), overwrite=overwrite,
                                   extra_files={PLAN_FILE: json.dumps(plan.to_dict(), indent=1) + "\n"})
    return manifest, plan
