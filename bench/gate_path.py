"""The KL gate and the whole requantize -> validate -> promote path, measured in one run on the
default model.

1. The gate's teacher-forced stage (three forwards over the held-out tokens: the candidate as
   served, in full precision, and the serving version; then the KL statistics) against one plain
   forward of the full-precision model over the same tokens (the issue's target: within 3.5x).
2. The whole path on a live server (`loop serve` of the base): requantize, validate (its engine
   stage included), promote (registry, hot-swap, canary), timed per phase; then a rollback puts
   the base back. Three passes: the configured plan budget twice (the first pays for measuring the
   serving version's eval success once; a plan other than the engine's swaps in a second engine),
   then budget 0 (the engine's own plan: an in-place reload).

    python bench/gate_path.py [--checkpoint DIR] [--dataset DIR] [--repeats 5] [--no-path] [key=value ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def gate_ratio(cfg, ckpt: str, dataset: str, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from kernels import QuantSpec
    from loop.serving import quantized_for_serving
    from loop.train import qat_spec
    from pipelines.logits import dataset_sequences, model_logprobs
    from pipelines.quantize import quantize_checkpoint
    from pipelines.validate import KLGate

    fmt, spec = qat_spec(cfg)
    seqs = dataset_sequences(dataset, "heldout", cfg.validate.heldout_sequences)
    base = ckpt_parent(ckpt)
    serving = quantized_for_serving(base, fmt, cfg.serve.w4a16_group_size, "bfloat16", cfg.bootstrap.cache_dir)
    cand = Path(ckpt).parent / f".bench-{Path(ckpt).name}-{fmt}"
    quantize_checkpoint(ckpt, cand, QuantSpec.from_dict(spec), overwrite=True)
    fp = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    one = best(lambda: model_logprobs(fp, seqs), repeats)
    gates = []
    for _ in range(repeats):
        g = KLGate(cand, ckpt, serving, seqs, cfg.validate)
        g.measure()
        gates.append(g.report.timings)
    fwd = min(t["forwards_s"] + t["kl_s"] for t in gates)
    out = {"tokens": seqs.num_tokens, "scored_tokens": seqs.num_scored, "one_forward_s": one,
           "gate_forwards_and_kl_s": fwd, "gate_with_load_s": min(t["load_s"] + t["forwards_s"] + t["kl_s"] for t in gates),
           "ratio": fwd / one, "one_forward_tokens_per_s": seqs.num_tokens / one,
           "gate_tokens_per_s": seqs.num_tokens / fwd}
    print(f"gate over {seqs.num_tokens} held-out tokens: 3 forwards + KL {fwd:.3f}s vs one plain forward {one:.3f}s: "
          f"{out['ratio']:.2f}x (target <= 3.5x); with checks and loading {out['gate_with_load_s']:.3f}s", flush=True)
    return out


def ckpt_parent(ckpt: str) -> str:
    from trainers.rl.manifest import load_checkpoint

    parent = load_checkpoint(ckpt).parent
    return parent


def whole_path(cfg, ckpt: str, dataset: str) -> list[dict]:
    """Three passes on one server: the configured plan budget twice (the first also measures the
    serving version's eval success once), then budget 0, the serving engine's own plan (every layer
    quantized): an in-place reload instead of a second engine."""
    import dataclasses

    from loop.collect import endpoint
    from loop.gate import requantize_phase, validate_phase
    from loop.promotion import promote_phase
    from pipelines.promote import AdminClient, Registry, rollback
    from trainers.rl.manifest import load_checkpoint

    policy = load_checkpoint(ckpt)
    out = []
    zero = dataclasses.replace(cfg, requantize=dataclasses.replace(cfg.requantize, max_full_precision_layers=0))
    with endpoint(cfg, policy.parent, Path(cfg.run_dir)) as ep:
        for i, cfg in enumerate((cfg, cfg, zero)):
            t = [time.perf_counter()]
            cand = requantize_phase(cfg, policy, dataset, Path(cfg.run_dir))
            t.append(time.perf_counter())
            verdict = validate_phase(cfg, cand, ep, Path(cfg.run_dir))
            g = verdict.gate
            t.append(time.perf_counter())
            outcome = promote_phase(cfg, verdict, ep)
            t.append(time.perf_counter())
            row = {"run": i, "budget_layers": cfg.requantize.max_full_precision_layers, "requantize_s": t[1] - t[0], "validate_s": t[2] - t[1], "promote_s": t[3] - t[2],
                   "total_s": t[3] - t[0], "outcome": outcome.status, "engine_stage_s": g.report.timings.get("engine_s"),
                   "swap": outcome.swap}
            out.append(row)
            print(f"path {i} (plan budget {row['budget_layers']} layers): requantize {row['requantize_s']:.1f}s, validate {row['validate_s']:.1f}s (engine stage "
                  f"{row['engine_stage_s']}s), promote {row['promote_s']:.1f}s (swap mode {outcome.swap.get('mode')}, "
                  f"pause {outcome.swap.get('pause_s', 0):.3f}s): {row['total_s']:.1f}s, {outcome.status} "
                  f"(target < 30 s)", flush=True)
            if outcome.status == "serving":
                rollback(Registry(cfg.tracking_uri, cfg.promote.model_name), AdminClient(ep.url, ep.admin_token))
    return out


def main() -> None:
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(REPO / "conf" / "agent_rl.yaml"))
    ap.add_argument("--checkpoint")
    ap.add_argument("--dataset")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-path", action="store_true", help="the gate ratio only (no server)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_intermixed_args()
    from loop.config import load_config
    from rollout.capabilities import detect

    sys.path.insert(0, str(REPO / "bench"))
    from requantize_plan import newest

    cfg = load_config(a.config, a.overrides)
    ckpt = a.checkpoint or newest(cfg.run_dir, "checkpoints")
    dataset = a.dataset or newest(cfg.run_dir, "datasets")
    print(detect().describe(), flush=True)
    result = {"gate": gate_ratio(cfg, ckpt, dataset, a.repeats)}
    if not a.no_path:
        result["path"] = whole_path(cfg, ckpt, dataset)
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
