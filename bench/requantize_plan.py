"""Requantize, measured side by side in one run on the default model:

1. the joint layer-plan search against the one-at-a-time baseline at the same budgets, both
   searched on the train split and measured again on the held-out split (the issue's target: joint
   KL <= 0.8x the baseline's), and whether a plan quantizing *more* layers had *lower* KL;
2. QAT against post-training quantization: KL(full precision || served format, every layer
   quantized) on the held-out split, of two checkpoints of the same training run (same base,
   dataset, config and seed) with and without QAT (the issue's target: QAT <= 0.5x PTQ).

    python bench/requantize_plan.py [--checkpoint DIR] [--dataset DIR] [--qat DIR --no-qat DIR]
                                    [--budgets 2 4 8] [--kib-budgets 256 512] [--sequences N]
                                    [--calibration N] [--selection N] [--measure-on DATASET] [--skip-qat]
                                    [key=value ...]

Defaults: the newest checkpoint and dataset under the config's run_dir (`loop run` makes them);
without --qat/--no-qat the two checkpoints are trained here (in-process, the config's trainer).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def newest(run_dir: str, kind: str) -> str:
    found = sorted((Path(run_dir) / kind).glob("*/flywheel_manifest.json"))
    if not found:
        sys.exit(f"nothing under {run_dir}/{kind}: run `loop run conf/agent_rl.yaml` first, or pass it")
    return str(found[-1].parent)


def heldout_kl(folder_fp: str, full_precision: list[str], spec, seqs, per_token: bool = False):
    """KL(fp || folder quantized with `full_precision` kept) on `seqs`, via the plan scorer's model:
    the mean, or (per_token) each scored position's."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipelines.requantize import PlanScorer

    model = AutoModelForCausalLM.from_pretrained(folder_fp, dtype=torch.float32)
    scorer = PlanScorer(model, spec, seqs)
    plan = frozenset(i for i, u in enumerate(scorer.units) if set(u.layers) <= set(full_precision))
    return scorer.per_token(plan) if per_token else scorer(plan)


def served_changed(parent: str, child: str, spec) -> float:
    """Fraction of the quantized weights whose served (grid) value differs between two checkpoints:
    how far training moved the served model."""
    import torch
    from transformers import AutoModelForCausalLM

    from kernels import fake_quant, quant_targets, weight_qparams

    a, b = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in (parent, child))
    changed = total = 0
    for name in quant_targets(a):
        wa, wb = a.get_submodule(name).weight.detach(), b.get_submodule(name).weight.detach()
        qa, qb = (fake_quant(w, *weight_qparams(w, spec), spec) for w in (wa, wb))
        changed, total = changed + int((qa != qb).sum()), total + qa.numel()
    return changed / total


def ratio_interval(a, b, seqs, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """90% interval of mean(a) / mean(b), per-token KLs of two plans on the same positions,
    resampling whole sequences (a sequence's positions are not independent draws)."""
    import torch

    counts = torch.tensor([sum(m[1:]) for m in seqs.sampled])
    seq = torch.repeat_interleave(torch.arange(len(counts)), counts)
    sa = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, seq, a.double())
    sb = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, seq, b.double())
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(len(counts), (draws, len(counts)), generator=g)
    r = sa[pick].sum(1) / sb[pick].sum(1)
    return r.quantile(0.05).item(), r.quantile(0.95).item()


def plans(ckpt: str, spec, calib, heldout, budgets: list[int], kib_budgets: list[int] = (),
          selection=None) -> list[dict]:
    """Per budget: both searches on calibration, measured on held-out, with the plan the loop would
    serve (the lower of the two on `selection`, other train episodes); and the oracle, the joint
    search run on held-out itself: what a search could at best find there (biased low: it also fits
    that slice's noise)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipelines.requantize import PlanScorer, RequantizeConfig, joint, search_plan

    rows = []
    configs = [(f"{k} layers", RequantizeConfig(max_full_precision_layers=k, max_evals=400)) for k in budgets]
    configs += [(f"{k} KiB", RequantizeConfig(max_full_precision_layers=1 << 20, max_extra_bytes=k * 1024,
                                              max_evals=400)) for k in kib_budgets]
    held = PlanScorer(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32), spec, heldout)

    def units(layers):
        return frozenset(i for i, u in enumerate(held.units) if set(u.layers) <= set(layers))

    for k, rq in configs:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        t0 = time.perf_counter()
        plan = search_plan(model, spec, calib, rq, selection=selection)
        search_s = round(time.perf_counter() - t0, 1)
        joint_t, base_t = (held.per_token(units(p)) for p in (plan.joint["plan"], plan.one_at_a_time["plan"]))
        held.scores.clear()  # max_evals counts the scorer's memo: each budget's oracle gets its own
        oracle = joint(held, rq, start=units(plan.one_at_a_time["plan"]))
        row = {"budget": k, "search_s": search_s, "plans_scored": len(plan.evaluated),
               "calib_joint": plan.joint["kl"], "calib_baseline": plan.one_at_a_time["kl"],
               "heldout_joint": joint_t.mean().item(), "heldout_baseline": base_t.mean().item(),
               "heldout_chosen": held(units(plan.full_precision)), "chosen": plan.selection.get("chosen", "joint"),
               "heldout_ratio_90": ratio_interval(joint_t, base_t, heldout),
               "heldout_oracle": oracle["kl"], "oracle_plan": oracle["plan"],
               "heldout_all_quantized": held(frozenset()),
               "joint_plan": plan.joint["plan"], "baseline_plan": plan.one_at_a_time["plan"],
               "more_quantized_lower_kl": len(plan.more_quantized_lower_kl),
               "example": plan.more_quantized_lower_kl[:1]}
        rows.append(row)
        b = row["heldout_baseline"]
        print(f"budget {k}: joint {row['calib_joint']:.3e} vs one-at-a-time {row['calib_baseline']:.3e} "
              f"(calibration, {row['calib_joint'] / row['calib_baseline']:.2f}x); held-out, baseline {b:.3e}: "
              f"joint {row['heldout_joint'] / b:.2f}x (90% interval {row['heldout_ratio_90'][0]:.2f}-"
              f"{row['heldout_ratio_90'][1]:.2f}x over sequences), the loop's choice ({row['chosen']}) "
              f"{row['heldout_chosen'] / b:.2f}x; the best plan searched on held-out itself "
              f"{row['heldout_oracle'] / b:.2f}x; all quantized {row['heldout_all_quantized'] / b:.2f}x; "
              f"{row['more_quantized_lower_kl']} scored pairs where quantizing one more unit lowered KL", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(REPO / "conf" / "agent_rl.yaml"))
    ap.add_argument("--checkpoint")
    ap.add_argument("--dataset")
    ap.add_argument("--qat")
    ap.add_argument("--no-qat")
    ap.add_argument("--budgets", type=int, nargs="*", default=[2, 4, 8], help="none: skip the plan search")
    ap.add_argument("--kib-budgets", type=int, nargs="*", default=[],
                    help="byte budgets (KiB the full-precision layers may add), searched after --budgets")
    ap.add_argument("--sequences", type=int, default=32, help="held-out episodes the plans are measured on")
    ap.add_argument("--calibration", type=int, help="train episodes the plans are searched on (default: --sequences)")
    ap.add_argument("--selection", type=int, help="train episodes after those that choose between the joint plan and "
                    "the baseline (default: requantize.selection_sequences)")
    ap.add_argument("--measure-on", help="a dataset (not --dataset) whose train episodes the plans are measured on "
                    "instead of --dataset's held-out split: e.g. the next cycle's")
    ap.add_argument("--skip-qat", action="store_true", help="only the plan search")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_intermixed_args()
    from kernels import QuantSpec
    from loop.bootstrap import bootstrap
    from loop.config import load_config
    from loop.train import qat_spec
    from pipelines.logits import dataset_sequences
    from rollout.capabilities import detect
    from trainers.rl.launch import run_training
    from trainers.rl.train import TrainJob

    cfg = load_config(a.config, a.overrides)
    ckpt = a.checkpoint or newest(cfg.run_dir, "checkpoints")
    dataset = a.dataset or newest(cfg.run_dir, "datasets")
    fmt, spec_d = qat_spec(cfg)
    if spec_d is None:
        sys.exit(f"serve.quant resolves to {fmt} here: nothing to requantize")
    spec = QuantSpec.from_dict(spec_d)
    n = a.calibration or a.sequences
    drawn = dataset_sequences(dataset, "train", n + (cfg.requantize.selection_sequences if a.selection is None
                                                     else a.selection))
    calib, selection = drawn.head(n), (drawn.rows(n) if len(drawn.ids) > n else None)
    # the held-out split is ~10% of a dataset's groups (one problem in some cycles): --measure-on
    # takes episodes of another dataset instead, e.g. the next cycle's, traffic this checkpoint served
    heldout = (dataset_sequences(a.measure_on, "train", a.sequences) if a.measure_on
               else dataset_sequences(dataset, "heldout", a.sequences))
    print(f"{detect().describe()}; {fmt}; checkpoint {ckpt}; calibration {calib.num_scored} scored tokens"
          f"; measured on {heldout.source} ({len(heldout.ids)} episodes, "
          f"{heldout.num_scored} scored tokens; 'held-out' below)", flush=True)
    rows = plans(ckpt, spec, calib, heldout, a.budgets, a.kib_budgets, selection)
    if a.skip_qat:
        return

    models = {"qat": a.qat, "no_qat": a.no_qat}
    tmp = Path(tempfile.mkdtemp(prefix="fw-qat-ptq-"))
    base = bootstrap(cfg.bootstrap, cfg.task).path
    ray = dataclasses.replace(cfg.ray)
    for name, qat in (("qat", True), ("no_qat", False)):
        if models[name] is None:
            rl = dataclasses.replace(cfg.trainer, qat=qat, num_workers=0, progress=False)
            models[name] = run_training(TrainJob(base, dataset, str(tmp / name), rl, spec_d), ray).path
    qat_kl = {n: heldout_kl(p, [], spec, heldout) for n, p in models.items()}
    moved = {n: served_changed(base, p, spec) for n, p in models.items()}
    ratio = qat_kl["qat"] / qat_kl["no_qat"]
    print(f"KL(fp || {fmt}) on held-out: QAT {qat_kl['qat']:.3e}, PTQ {qat_kl['no_qat']:.3e}: {ratio:.2f}x "
          f"(target <= 0.5x); served values changed from the base: QAT {moved['qat']:.3%}, PTQ "
          f"{moved['no_qat']:.3%}", flush=True)
    print(json.dumps({"format": fmt, "checkpoint": ckpt, "dataset": dataset, "plans": rows,
                      "qat_vs_ptq": {"kl": qat_kl, "ratio": ratio, "served_changed": moved,
                                                 "checkpoints": models}}, indent=1, default=str))


if __name__ == "__main__":
    main()
