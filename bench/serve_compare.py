"""Side by side in one run: this server (tracing on) vs vLLM's bare OpenAI server, same model, same
engine settings, same load; then prefix-cache TTFT cold/warm, hot-swap pause (idle, and what new
requests wait under load per swap mode against that load: bench/swap_pause.py), and
speculative (draft model, n-gram) vs plain decoding, all on this server.

    python bench/serve_compare.py [--model DIR] [--requests 192] [--concurrency 16] [--max-tokens 64]

Without --model it uses the tiny test base (bootstrapping it if needed). Both servers run at the
same time (rounds alternate between them, so drift on a shared machine hits both alike).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "rollout" / "server"))


def start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def wait(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} died:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not up")


def stop(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


async def load(url: str, n: int, conc: int, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 400) for _ in range(48)] for _ in range(n)]
    lat, toks = [], 0
    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=conc * 2)) as client:
        async def one(p):
            nonlocal toks
            async with sem:
                t = time.perf_counter()
                r = await client.post(url + "/v1/completions", json={
                    "model": "flywheel", "prompt": p, "max_tokens": max_tokens, "ignore_eos": True,
                    "temperature": 1.0})
                lat.append(time.perf_counter() - t)
                r.raise_for_status()
                toks += r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    lat.sort()
    return {"tok_s": toks / wall, "p50_ms": 1000 * lat[len(lat) // 2], "p99_ms": 1000 * lat[int(len(lat) * 0.99) - 1],
            "wall_s": wall}


async def ttft(url: str, prompt: list[int]) -> float:
    async with httpx.AsyncClient(timeout=60) as client:
        t = time.perf_counter()
        async with client.stream("POST", url + "/v1/completions", json={
                "model": "flywheel", "prompt": prompt, "max_tokens": 4, "stream": True, "temperature": 0}) as r:
            async for _ in r.aiter_raw():
                return 1000 * (time.perf_counter() - t)
    return float("nan")


async def greedy_tok_s(url: str, prompts: list[list[int]], max_tokens: int) -> float:
    toks, t0 = 0, time.perf_counter()
    async with httpx.AsyncClient(timeout=120) as client:
        for p in prompts:  # batch 1: where speculation could help
            r = await client.post(url + "/v1/completions", json={"model": "flywheel", "prompt": p, "max_tokens": max_tokens,
                                                                 "temperature": 0, "ignore_eos": True})
            toks += r.json()["usage"]["completion_tokens"]
    return toks / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-spec", action="store_true")
    a = ap.parse_args()

    from loop.config import load_config
    from rollout.server.config import ServeConfig, vllm_cli_args

    cfg = load_config(REPO / "conf" / "tiny.yaml", [f"bootstrap.cache_dir={REPO / '.cache' / 'flywheel-test'}"])
    if a.model is None:
        from loop.bootstrap import bootstrap

        a.model = bootstrap(cfg.bootstrap, cfg.task).path
    tmp = Path(tempfile.mkdtemp(prefix="fw-bench-"))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "FLYWHEEL_ADMIN_TOKEN": "bench"}
    pa, pb, pc = 18411, 18412, 18413
    bare_cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                *vllm_cli_args(ServeConfig(), cfg.engine, a.model, port=pa)]
    ours_cmd = [sys.executable, "-m", "loop.cli", "serve", str(REPO / "conf" / "tiny.yaml"), f"serve.model={a.model}",
                f"serve.port={pb}", f"serve.trace_root={tmp / 'traces'}", f"serve.max_queue={4 * a.concurrency}"]
    bare, ours = start(bare_cmd, tmp / "bare.log", env), start(ours_cmd, tmp / "ours.log", env)
    ua, ub = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
    results: dict = {}
    try:
        wait(ua, bare, tmp / "bare.log")
        wait(ub, ours, tmp / "ours.log")
        asyncio.run(load(ua, 32, a.concurrency, 8, 0))  # warm both
        asyncio.run(load(ub, 32, a.concurrency, 8, 0))
        rows = {"bare": [], "ours": []}
        for r in range(a.rounds):
            for name, url in (("bare", ua), ("ours", ub)) if r % 2 == 0 else (("ours", ub), ("bare", ua)):
                rows[name].append(asyncio.run(load(url, a.requests, a.concurrency, a.max_tokens, seed=100 + r)))
        for name in rows:
            results[name] = {k: statistics.median(x[k] for x in rows[name]) for k in rows[name][0]}
        results["throughput_ratio"] = results["ours"]["tok_s"] / results["bare"]["tok_s"]
        stop(bare)

        rng = random.Random(9)
        cold, warm = [], []
        for i in range(5):
            p = [rng.randrange(10, 400) for _ in range(320)]
            cold.append(asyncio.run(ttft(ub, p)))
            warm.append(asyncio.run(ttft(ub, p)))
        results["ttft_ms"] = {"cold_320tok": statistics.median(cold), "warm_320tok": statistics.median(warm)}

        prompts = [[rng.randrange(10, 400) for _ in range(32)] for _ in range(8)]
        asyncio.run(greedy_tok_s(ub, prompts[:2], 8))
        results["spec_tok_s_batch1"] = {"plain": asyncio.run(greedy_tok_s(ub, prompts, 64))}

        from srv_util import perturbed_copy

        new = perturbed_copy(a.model, tmp / "fp2")
        swaps = []
        for path in (new, a.model, new, a.model):
            t = time.perf_counter()
            r = httpx.post(ub + "/admin/weights", json={"path": str(path)}, headers={"authorization": "Bearer bench"},
                           timeout=300)
            r.raise_for_status()
            swaps.append({**r.json(), "http_s": time.perf_counter() - t})
        results["swap"] = {k: statistics.median(s[k] for s in swaps)
                           for k in ("pause_s", "load_s", "drain_s", "canary_s", "http_s")}
        from swap_pause import measure, report_line  # new requests' wait during a swap vs the same load, per mode

        results["swap_under_load"] = {mode: {k: v for k, v in r.items() if k != "runs"} for mode, r in
                                      measure(ub, "bench", [str(new), str(a.model)], a.concurrency, 2).items()}
        stop(ours)
        if not a.skip_spec:
            from test_speculative_and_crash import build_draft

            draft = build_draft(a.model, tmp / "draft")  # random 1-layer: acceptance is low
            raw = "serve.logprobs_mode=raw_logprobs"  # vLLM: speculated tokens' processed logprobs are NaN
            variants = (("draft_random_1layer", ["serve.speculative.method=draft",
                                                 f"serve.speculative.draft_model={draft}", raw]),
                        ("ngram", ["serve.speculative.method=ngram", raw]))
            for name, sc in variants:
                cmd = [*ours_cmd[:-3], f"serve.port={pc}", f"serve.trace_root={tmp / name}", *sc]
                proc = start(cmd, tmp / f"{name}.log", env)
                try:
                    wait(f"http://127.0.0.1:{pc}", proc, tmp / f"{name}.log")
                    asyncio.run(greedy_tok_s(f"http://127.0.0.1:{pc}", prompts[:2], 8))
                    results["spec_tok_s_batch1"][name] = asyncio.run(
                        greedy_tok_s(f"http://127.0.0.1:{pc}", prompts, 64))
                finally:
                    stop(proc)
    finally:
        stop(bare)
        stop(ours)
    print(json.dumps(results, indent=2))
    for mode, m in results.get("swap_under_load", {}).items():
        print(report_line(mode, m))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
