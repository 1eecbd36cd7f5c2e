"""How long a hot-swap makes new requests wait, side by side with the same load without a swap,
for each swap mode ("drain": wait for in-flight requests; "keep": freeze them in the engine and
recompute their KV with the new weights; "keep_stale_kv": freeze them and keep their old KV).

    python bench/swap_pause.py [--model DIR] [--concurrency 16] [--swaps 4]

`concurrency` clients stream long completions back to back (the load); a probe sends a one-token
request every 20 ms and times it. Per swap: the slowest probe that was in flight during the swap
(what a new request waited) over the probes' median under the same load before the swap. Each
mode's ratio is the median over its swaps. bench/serve_compare.py runs the same measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "rollout" / "server"))


MODES = {"drain": {"mode": "drain"}, "keep": {"mode": "keep"},
         "keep_stale_kv": {"mode": "keep", "clear_cache": False}}  # the in-flight KV of the old weights stays


async def pause_under_load(url: str, token: str, path: str | None, mode: str, concurrency: int = 16,
                           settle_s: float = 2.0) -> dict:
    stop, probes = asyncio.Event(), []  # (start, end)
    failures = []
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        async def stream_worker(i: int) -> None:
            while not stop.is_set():
                body = {"model": "flywheel", "prompt": [10 + i, 11, 12, 13], "max_tokens": 96, "stream": True,
                        "ignore_eos": True, "temperature": 1.0}
                async with client.stream("POST", url + "/v1/completions", json=body) as r:
                    raw = b"".join([c async for c in r.aiter_raw()])
                    if r.status_code != 200 or b"[DONE]" not in raw:
                        failures.append(r.status_code)

        async def probe() -> None:
            while not stop.is_set():
                t = time.perf_counter()
                r = await client.post(url + "/v1/completions", json={"model": "flywheel", "prompt": [5, 6, 7],
                                                                     "max_tokens": 1, "temperature": 0})
                probes.append((t, time.perf_counter()))
                if r.status_code != 200:
                    failures.append(r.status_code)
                await asyncio.sleep(0.02)

        tasks = [asyncio.create_task(stream_worker(i)) for i in range(concurrency)] + [asyncio.create_task(probe())]
        await asyncio.sleep(settle_s)
        if path is None:  # a warm-up: the first requests after a start are slow
            stop.set()
            await asyncio.gather(*tasks)
            return {}
        t0 = time.perf_counter()
        r = await client.post(url + "/admin/weights", json={"path": path, **MODES[mode]},
                              headers={"authorization": f"Bearer {token}"}, timeout=300)
        t1 = time.perf_counter()
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*tasks)
    r.raise_for_status()
    before = [e - s for s, e in probes if e < t0]
    if not before:
        raise RuntimeError(f"no probe finished before the swap ({len(probes)} probes, failures {failures[:5]}, "
                           f"swap {r.status_code} {r.text[:300]})")
    during = [e - s for s, e in probes if s < t1 and e > t0]
    load = statistics.median(before)
    return {"mode": mode, "load_probe_p50_s": load, "swap_max_probe_s": max(during), "ratio": max(during) / load,
            "server_pause_s": r.json()["pause_s"], "kept_in_flight": r.json().get("kept_in_flight", 0),
            "failed_requests": len(failures)}


def measure(url: str, token: str, paths: list[str], concurrency: int, swaps: int) -> dict:
    """Alternate the modes swap by swap (drift hits all alike); `paths` alternate too."""
    out: dict = {mode: [] for mode in MODES}
    asyncio.run(pause_under_load(url, token, None, "", concurrency, settle_s=5.0))
    for i in range(len(MODES) * swaps):
        mode = list(MODES)[i % len(MODES)]
        out[mode].append(asyncio.run(pause_under_load(url, token, paths[i % len(paths)], mode, concurrency)))
    return {mode: {"ratio_median": statistics.median(x["ratio"] for x in runs),
                   "swap_max_probe_s_median": statistics.median(x["swap_max_probe_s"] for x in runs),
                   "load_probe_p50_s_median": statistics.median(x["load_probe_p50_s"] for x in runs),
                   "failed_requests": sum(x["failed_requests"] for x in runs), "runs": runs}
            for mode, runs in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--swaps", type=int, default=4, help="per mode")
    a = ap.parse_args()
    from loop.config import load_config
    from rollout.server.process import ServerProcess
    from srv_util import perturbed_copy

    conf = REPO / "conf" / "tiny.yaml"
    cfg = load_config(conf, [f"bootstrap.cache_dir={REPO / '.cache' / 'flywheel-test'}"])
    if a.model is None:
        from loop.bootstrap import bootstrap

        a.model = bootstrap(cfg.bootstrap, cfg.task).path
    tmp = Path(tempfile.mkdtemp(prefix="fw-swap-"))
    new = perturbed_copy(a.model, tmp / "fp2")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with ServerProcess(conf, a.model, tmp / "data", tmp / "server.log",
                       [f"serve.max_queue={4 * a.concurrency}", "serve.drain_timeout_s=30"]) as srv:
        result = measure(srv.url, srv.admin_token, [str(new), str(a.model)], a.concurrency, a.swaps)
    for mode in result:
        print(f"{mode}: new requests waited {result[mode]['swap_max_probe_s_median']:.3f} s vs "
              f"{result[mode]['load_probe_p50_s_median']:.3f} s under the same load: "
              f"ratio {result[mode]['ratio_median']:.2f} (failed requests: {result[mode]['failed_requests']})")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
