"""The serving fleet on this machine, side by side in one run: 1 vs 2 replicas behind vllm-router,
the router's added latency, and a measured model of k replicas.

    python bench/fleet.py [--problems 32] [--group 4] [--concurrency 16] [--rounds 3] [--probes 60]

1. One replica behind the router. Latency: one-token completions, sequential, alternating direct
   (the replica's own port), through the router, and through the version splitter in front of it
   (the fleet's front door); the medians' differences are what each hop adds per request. Throughput: the collector's calculator episodes, direct and through the router
   (median episodes/s over `--rounds` rounds after a warm-up).
2. Two replicas behind the router (each vLLM worker on its own core: on this 2-core machine the
   two replicas' front ends, the router and this client share those same 2 cores, so 2 replicas
   cannot double anything here; the ratio says what a second replica buys on the same cores).
   Throughput as in 1; then weight fan-out: each replica swapped onto a perturbed copy of the
   model, one at a time out of the router's ring (Fleet.roll: capacity N-1).
3. The dataset build over the fleet's one trace table (rows, seconds).

The model of k replicas, from these numbers (its assumptions printed with it): trace rows/s grow
with k (each replica writes its own WAL and Parquet parts; shared storage's write bandwidth is
not measured here); the dataset build is one process over all rows (seconds per row measured);
a rolling fan-out takes k x one replica's swap (one at a time) and moves k x model bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]  # bench/kernels.py
sys.path.insert(0, str(REPO / "tests" / "rollout" / "server"))  # srv_util.perturbed_copy


def probe_ms(url: str, n: int) -> list[float]:
    import httpx

    out = []
    with httpx.Client(timeout=60) as c:
        for i in range(n):
            t = time.perf_counter()
            r = c.post(url + "/v1/completions", headers={"x-session-id": f"probe-{i}"},
                       json={"model": "flywheel", "prompt": [1, 2, 3, 4], "max_tokens": 1, "temperature": 0})
            r.raise_for_status()
            out.append((time.perf_counter() - t) * 1000)
    return out


def episodes_per_s(url: str, tok, a, rounds: int) -> tuple[float, float]:
    """Median episodes/s over `rounds` (after one warm-up round), and trace rows written per second."""
    from rollout.collector import CollectorConfig, collect_sync
    from rollout.tasks.calculator import TASK, make_problems

    cfg = CollectorConfig(base_url=url, group_size=a.group, concurrency=a.concurrency, temperature=1.0, max_tokens=48,
                          progress=False)
    rates, rows = [], []
    for r in range(rounds + 1):
        _, st = collect_sync(make_problems("train", a.problems, seed=100 + r), tok, cfg, TASK)
        if r:
            rates.append(st.episodes_ok / st.seconds)
            rows.append((st.requests - a.problems) / st.seconds)  # turns (traces) per second; feedback posts out
    return statistics.median(rates), statistics.median(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--probes", type=int, default=60)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from loop.bootstrap import bootstrap
    from loop.config import load_config
    from pipelines.traces_to_dataset import DatasetConfig, build_dataset
    from rollout.artifacts import checkpoint_sha256
    from rollout.server.fleet import Fleet
    from srv_util import perturbed_copy

    conf = REPO / "conf" / "tiny.yaml"
    cache = REPO / ".cache" / "flywheel-test"
    cfg = load_config(conf, [f"bootstrap.cache_dir={cache}"])
    base = bootstrap(cfg.bootstrap, cfg.task).path
    tok = AutoTokenizer.from_pretrained(base)
    tmp = Path(tempfile.mkdtemp(prefix="fw-fleet-"))
    over = [f"bootstrap.cache_dir={cache}", "serve.quant=none", f"serve.weights_roots=[{tmp},{REPO / '.cache'}]",
            "serve.drain_timeout_s=30", f"serve.max_queue={4 * a.concurrency}"]
    res: dict = {}
    with Fleet(conf, base, tmp / "one" / "data", tmp / "one" / "logs", replicas=1, overrides=over) as f1:
        direct, routed, front = f1.servers[0].url, f1.router.url, f1.url
        probe_ms(front, 10)
        d, r, sp = [], [], []
        for _ in range(a.probes // 10):  # alternate in blocks: drift hits all alike
            d += probe_ms(direct, 10)
            r += probe_ms(routed, 10)
            sp += probe_ms(front, 10)
        res["probe_direct_ms"], res["probe_router_ms"] = statistics.median(d), statistics.median(r)
        res["probe_front_ms"] = statistics.median(sp)
        res["eps_1_direct"], _ = episodes_per_s(direct, tok, a, a.rounds)
        res["eps_1_router"], res["rows_per_s_1"] = episodes_per_s(routed, tok, a, a.rounds)
        res["eps_1_front"], _ = episodes_per_s(front, tok, a, a.rounds)
    new = perturbed_copy(base, tmp / "fp2")
    with Fleet(conf, base, tmp / "two" / "data", tmp / "two" / "logs", replicas=2, overrides=over) as f2:
        res["eps_2_router"], res["rows_per_s_2"] = episodes_per_s(f2.router.url, tok, a, a.rounds)
        swaps = f2.roll(str(new), checkpoint_sha256(new))
        res["swap_s"] = statistics.median(s["seconds"] for s in swaps)
        res["swap_versions"] = [s.get("weight_version") for s in swaps]
        f2.flush()
        t = time.perf_counter()
        m = build_dataset(DatasetConfig(trace_root=f2.servers[0].trace_root, out_dir=tmp / "ds", tokenizer=str(base),
                                        heldout_fraction=0.0, logprobs_mode="processed_logprobs"))
        res["build_s"], res["build_rows"] = time.perf_counter() - t, m.rows_read
    res["model_bytes"] = sum(p.stat().st_size for p in Path(base).iterdir() if p.suffix == ".safetensors")
    print(json.dumps(res, indent=2))
    print(report(res))


def report(r: dict) -> str:
    per_row = r["build_s"] / max(r["build_rows"], 1)
    k = 100
    return "\n".join([
        f"router adds {r['probe_router_ms'] - r['probe_direct_ms']:.2f} ms per request (one-token completion: "
        f"{r['probe_router_ms']:.2f} ms routed vs {r['probe_direct_ms']:.2f} ms direct, "
        f"ratio {r['probe_router_ms'] / r['probe_direct_ms']:.2f})",
        f"version splitter in front of the router adds {r['probe_front_ms'] - r['probe_router_ms']:.2f} ms more "
        f"({r['probe_front_ms']:.2f} ms)",
        f"1 replica: {r['eps_1_direct']:.1f} episodes/s direct, {r['eps_1_router']:.1f} through the router "
        f"(ratio {r['eps_1_router'] / r['eps_1_direct']:.2f}), {r['eps_1_front']:.1f} through splitter + router "
        f"(ratio {r['eps_1_front'] / r['eps_1_direct']:.2f})",
        f"2 replicas through the router: {r['eps_2_router']:.1f} episodes/s, {r['eps_2_router'] / r['eps_1_router']:.2f}x "
        "1 replica (2 cores shared by both replicas' workers, front ends, the router and the client)",
        f"rolling fan-out: {r['swap_s']:.2f} s per replica for {r['model_bytes'] / 1e6:.1f} MB; versions {r['swap_versions']}",
        f"dataset build: {r['build_s']:.2f} s for {r['build_rows']} rows ({per_row * 1e3:.2f} ms/row)",
        f"model at k={k} replicas (each at this machine's 1-replica rate; storage not the bottleneck): "
        f"{k * r['rows_per_s_1']:.0f} trace rows/s; a 10-minute window's dataset build "
        f"{k * r['rows_per_s_1'] * 600 * per_row / 60:.0f} min in one process; rolling fan-out {k * r['swap_s'] / 60:.1f} min "
        f"one at a time ({k * r['swap_s'] / 10 / 60:.1f} min in waves of 10, capacity 90%), "
        f"{k * r['model_bytes'] / 1e9:.2f} GB moved (x model bytes: a 7B W4A16 model, ~4 GB, moves 400 GB)",
    ])


if __name__ == "__main__":
    main()
