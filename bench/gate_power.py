"""The gate's success test on planted candidates, through the engine: how often it promotes each.

    python bench/gate_power.py --run RUN_DIR [--cycle K] [--trials 20] [--problems 200] [key=value ...]

From a `loop run`'s folder, the serving version after cycle K-1 (the base when K is 1) and cycle
K's candidate ("next", the true next checkpoint), planted candidates:
- serving itself (equal: the test's rate for a candidate no better; a promotion would be a no-op),
- the base model (an older, worse version; for K = 1 the same as serving),
- next with 10% of its update reversed (serving + delta, the sign of a random 10% of delta's entries
  flipped in every matrix, then quantized with next's own spec and layer plan),
- next itself.
Each model plays trials x problems fresh eval problems (one eval seed, never task.seed's) at the
rollout temperature in a child engine (loop/evaluate.py, as the gate runs it); trial i is problems
[i*P, (i+1)*P) of every model: paired, as in the gate. Prints, per candidate, the mean paired delta
and how many of the trials the gate's rule (validate.min_success_delta, validate.success_alpha,
pipelines/paired.py) promotes, with a 90% Wilson interval.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def wilson(k: int, n: int, z: float = 1.645) -> tuple[float, float]:
    p = k / n
    mid, half = (p + z * z / (2 * n)), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (mid - half) / (1 + z * z / n), (mid + half) / (1 + z * z / n)


def reversed_update(serving_fp: str, next_fp: str, next_served: str, out: Path, fraction: float, seed: int = 0) -> str:
    """serving + delta with the sign of `fraction` of delta's matrix entries flipped, served as next is."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from pipelines.quantize import load_manifest, quantize_checkpoint

    fp = out / "fp"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(next_fp, fp)
    (fp / "flywheel_manifest.json").unlink(missing_ok=True)
    g = torch.Generator().manual_seed(seed)
    for shard in sorted(Path(next_fp).glob("*.safetensors")):
        a, b = load_file(Path(serving_fp) / shard.name), load_file(shard)
        for k, v in b.items():
            if v.is_floating_point() and v.ndim == 2:
                flip = torch.rand(v.shape, generator=g) < fraction
                b[k] = (a[k] + torch.where(flip, -(v - a[k]), v - a[k])).contiguous()
        save_file(b, fp / shard.name, metadata={"format": "pt"})
    m = load_manifest(next_served)
    plan = tuple(n for n in m.ignored_layers if not n.endswith("lm_head"))
    return quantize_checkpoint(fp, out / "served", m.spec, full_precision=plan, parent=str(fp)).path


def play(config: str, model: str, quant: str, overrides: list[str], n: int, seed: str, t: float) -> list[float]:
    from loop.evaluate import served_success

    res = served_success(config, model, quant, [*overrides, f"task.num_eval_problems={n}"], temperatures=(t,),
                         eval_seed=seed)
    return res["outcomes"][f"T={t}"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a `loop run` folder (its loop_state.json)")
    p.add_argument("--config", default="conf/agent_rl.yaml")
    p.add_argument("--cycle", type=int, default=2, help="cycle K: its candidate is next, what served before it is serving")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--problems", type=int, default=200)
    p.add_argument("--reverse", type=float, default=0.1)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()

    from loop.config import load_config
    from loop.configs import to_yaml
    from pipelines.paired import paired_test

    cfg = load_config(a.config, a.overrides)
    state = json.loads((Path(a.run) / "loop_state.json").read_text())
    cycles = state["cycles"]
    before = [c for c in cycles[:a.cycle - 1] if c.get("outcome") == "serving"]
    serving = (before[-1]["done"]["requantize"] if before else None)
    base = state["base"]["path"]
    serving_fp, serving_served = (serving["fp"], serving["path"]) if serving else (base, None)
    nxt = cycles[a.cycle - 1]["done"]["requantize"]
    work = Path(a.run) / "bench-gate-power"
    work.mkdir(exist_ok=True)
    if serving_served is None:  # the base as the server quantizes it
        from loop.serving import resolve

        serving_served = resolve(cfg, base).path
    reversed_path = reversed_update(serving_fp, nxt["fp"], nxt["path"], work / "reversed", a.reverse)
    models = {"serving itself": serving_served, "base": base, f"next, {a.reverse:.0%} of its update reversed":
              reversed_path, "next (the true next checkpoint)": nxt["path"]}
    n, seed, t = a.trials * a.problems, f"gate-power-{cfg.task.seed}", cfg.collect.rollout.temperature
    (work / "gate.yaml").write_text(to_yaml(cfg))
    outcomes = {}
    for name, path in {"serving": serving_served, **models}.items():  # "serving itself": played again, new samples
        outcomes[name] = play(str(work / "gate.yaml"), path, cfg.serve.quant, [], n, seed, t)
        print(f"[gate_power] {name}: {sum(outcomes[name]) / n:.1%} over {n} problems ({path})", flush=True)
    v = cfg.validate
    print(f"\ngate: paired test, {a.problems} fresh problems per trial, promote when the {1 - v.success_alpha:.0%} "
          f"lower bound of the delta > {v.min_success_delta:+g} (stated: <= {v.success_alpha:.0%} promoted when "
          f"{-v.min_success_delta:.0%} worse); {a.trials} trials each; serving {serving_served}")
    print(f"{'candidate':<42} {'success':>8} {'delta':>8} {'promoted':>9} {'90% interval':>14}")
    rows = []
    s = outcomes["serving"]
    for name in models:
        c = outcomes[name]
        chunks = [slice(i * a.problems, (i + 1) * a.problems) for i in range(a.trials)]
        tests = [paired_test(c[sl], s[sl], v.min_success_delta, v.success_alpha) for sl in chunks]
        k = sum(x.passed for x in tests)
        lo, hi = wilson(k, a.trials)
        delta = sum(c) / n - sum(s) / n
        rows.append({"candidate": name, "success": sum(c) / n, "delta": delta, "promoted": k, "trials": a.trials,
                     "interval": [lo, hi]})
        print(f"{name:<42} {sum(c) / n:>8.1%} {delta:>+8.3f} {k:>4}/{a.trials:<4} {lo:>6.0%}-{hi:<6.0%}")
    (work / "gate_power.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
