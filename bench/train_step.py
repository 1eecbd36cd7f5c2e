"""The RL step's speed side by side, in one run, on the default model and a real RL dataset:

1. RL step vs a plain torch step (forward, token-mean cross-entropy on the same sampled tokens,
   backward, clip, AdamW) of the same QAT-prepared model on the same minibatches: target >= 0.85x;
2. computing the prompt of each piece of a group once (`prefix_rows`) vs a padded forward of every row;
3. the cost of QAT: the RL step on the prepared model vs on the plain one;
4. Ray's overhead: the same job under Ray Train's TorchTrainer with 1 and 2 workers vs in this
   process: start-up seconds (wall time beyond the job's own) and the per-step time ratio.

    python bench/train_step.py [--dataset DIR] [--model DIR] [--steps 6]

The dataset defaults to the newest under runs/agent_rl/datasets (`loop run conf/agent_rl.yaml`
makes one), the model to the dataset's policy (the default config's base). Step times are
medians over the steps after the first (warm-up).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def plain_steps(model, episodes, plan, pad_id: int) -> list[float]:
    """Seconds per plain step on the plan's minibatches (sampled tokens per step are the same)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6)
    times = []
    for _, rows in plan:
        t0 = time.perf_counter()
        mb = episodes.minibatch(rows, pad_id)
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), mb.input_ids[:, 1:], reduction="none")
        loss = (nll * mb.loss_mask).sum() / mb.loss_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def med(xs: list[float]) -> float:
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset")
    ap.add_argument("--model")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip-ray", action="store_true")
    a = ap.parse_args()
    from loop.config import load_config
    from loop.train import qat_spec
    from trainers.rl.data import check_dataset, load_episodes
    from trainers.rl.launch import RayConfig, ensure_ray, run_training
    from trainers.rl.train import TrainJob, minibatch_plan, prepare_policy, train

    cfg = load_config(REPO / "conf" / "agent_rl.yaml")
    if a.dataset is None:
        found = sorted((REPO / cfg.run_dir / "datasets").glob("*/flywheel_manifest.json"))
        if not found:
            sys.exit("no dataset: run `loop run conf/agent_rl.yaml` first, or pass --dataset")
        a.dataset = str(found[-1].parent)
    if a.model is None:
        from loop.bootstrap import bootstrap

        a.model = bootstrap(cfg.bootstrap, cfg.task).path
    fmt, spec = qat_spec(cfg)
    torch.set_num_threads(os.cpu_count() or 1)
    rl = dataclasses.replace(cfg.trainer, max_steps=a.steps, epochs=100, progress=False, num_workers=0,
                             qat=spec is not None)
    episodes = load_episodes(check_dataset(a.dataset), rl.adv_estimator, rl.norm_adv_by_std, rl.min_group_size)
    plan = minibatch_plan(episodes.group_ids, rl, 1)
    tokens = [int(sum(episodes.loss_mask[i].sum() for i in rows)) for _, rows in plan]
    tmp = Path(tempfile.mkdtemp(prefix="fw-bench-train-"))
    out: dict = {"dataset": a.dataset, "model": a.model, "serving_format": fmt, "steps": a.steps,
                 "episodes_per_step": rl.minibatch_episodes, "sampled_tokens_per_step": statistics.median(tokens)}

    def rl_run(name: str, **change) -> dict:
        job = TrainJob(a.model, a.dataset, str(tmp / name), dataclasses.replace(rl, **change), spec)
        t0 = time.perf_counter()
        m = train(job) if job.rl.num_workers == 0 else run_training(job, RayConfig())
        wall = time.perf_counter() - t0
        return {"step_s": med([h["step_seconds"] for h in m.history]), "wall_s": wall, "job_s": m.wall_seconds}

    model = prepare_policy(a.model, rl, spec)
    pad_id = model.config.pad_token_id or 0
    plain_qat = med(plain_steps(model.train(), episodes, plan, pad_id))
    rl_qat = rl_run("rl_qat")
    out["plain_step_s"] = plain_qat
    out["rl_step_s"] = rl_qat["step_s"]
    out["rl_vs_plain_tokens_per_s"] = plain_qat / rl_qat["step_s"]
    out["rl_step_s_no_share"] = rl_run("rl_no_share", prefix_rows=1)["step_s"]
    out["share_prefix_speedup"] = out["rl_step_s_no_share"] / rl_qat["step_s"]
    if spec is not None:
        plain_model = prepare_policy(a.model, dataclasses.replace(rl, qat=False), None)
        out["plain_step_s_no_qat"] = med(plain_steps(plain_model.train(), episodes, plan, pad_id))
        rl_plain = rl_run("rl_no_qat", qat=False)
        out["rl_step_s_no_qat"] = rl_plain["step_s"]
        out["qat_cost_rl_step"] = rl_qat["step_s"] / rl_plain["step_s"]
    if not a.skip_ray:
        out["ray_init_s"] = ensure_ray(cfg.ray)
        for n in (1, 2):
            r = rl_run(f"ray{n}", num_workers=n)
            out[f"ray{n}_startup_s"] = r["wall_s"] - r["job_s"]
            out[f"ray{n}_step_s"] = r["step_s"]
            out[f"ray{n}_step_ratio"] = r["step_s"] / rl_qat["step_s"]
    print(json.dumps(out, indent=2))
    print(f"RL step vs plain forward+backward on the same tokens ({out['sampled_tokens_per_step']:.0f} sampled "
          f"tokens/step, {fmt} QAT): {out['rl_vs_plain_tokens_per_s']:.2f}x (target >= 0.85)")
    print(f"Each piece's prompt computed once (prefix_rows {rl.prefix_rows}): RL step {out['share_prefix_speedup']:.2f}x faster "
          f"than with every row's prompt computed")
    if "qat_cost_rl_step" in out:
        print(f"QAT cost: RL step {out['qat_cost_rl_step']:.2f}x the plain model's "
              f"(plain step {out['plain_step_s'] / out['plain_step_s_no_qat']:.2f}x)")
    for n in (1, 2):
        if f"ray{n}_step_s" in out:
            print(f"Ray TorchTrainer, {n} worker(s): start-up {out[f'ray{n}_startup_s']:.1f} s "
                  f"(+ runtime {out['ray_init_s']:.1f} s once), step {out[f'ray{n}_step_ratio']:.2f}x in-process")


if __name__ == "__main__":
    main()
