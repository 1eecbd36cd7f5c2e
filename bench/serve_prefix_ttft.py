"""Time to first token with a cold versus a warm prefix, through this server, on a model whose
prefill is long enough to see (the tiny test model prefills 320 tokens in ~2 ms, under the HTTP
overhead): a random-init Qwen2 (~30M parameters, same tokenizer), 1,500-token prompts.

    python bench/serve_prefix_ttft.py [--tokens 1500] [--repeats 5]

Prints median TTFT cold / warm / warm-with-new-suffix and the cached prompt tokens the traces
recorded for each kind of request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
# the repo before bench/: bench/kernels.py must not shadow the `kernels` package (serve_compare is found last)
sys.path[:] = [str(REPO)] + [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"] + [str(REPO / "bench")]


def build_wide(base: str, dst: Path) -> Path:
    from transformers import AutoTokenizer

    from trainers.bootstrap.model import ModelConfig, build_model

    tok = AutoTokenizer.from_pretrained(base)
    model = build_model(ModelConfig(vocab_size=len(tok), hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                                    intermediate_size=1536, max_position_embeddings=2048), tok, seed=0)
    model.save_pretrained(str(dst), safe_serialization=True)
    for p in Path(base).iterdir():
        if p.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(p, dst / p.name)
    return dst


async def ttft(url: str, prompt: list[int]) -> tuple[float, str]:
    async with httpx.AsyncClient(timeout=120) as client:
        t = time.perf_counter()
        async with client.stream("POST", url + "/v1/completions", json={
                "model": "flywheel", "prompt": prompt, "max_tokens": 2, "stream": True, "temperature": 0}) as r:
            async for _ in r.aiter_raw():
                return 1000 * (time.perf_counter() - t), r.headers["x-flywheel-trace-id"]
    raise RuntimeError("no chunk")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    from serve_compare import start, stop, wait

    from loop.bootstrap import bootstrap
    from loop.config import load_config
    from rollout.traces import read_traces

    cfg = load_config(REPO / "conf" / "tiny.yaml", [f"bootstrap.cache_dir={REPO / '.cache' / 'flywheel-test'}"])
    base = bootstrap(cfg.bootstrap, cfg.task).path
    tmp = Path(tempfile.mkdtemp(prefix="fw-ttft-"))
    model = build_wide(base, tmp / "wide")
    port, root = 18421, tmp / "data"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "FLYWHEEL_ADMIN_TOKEN": "bench"}
    proc = start([sys.executable, "-m", "loop.cli", "serve", str(REPO / "conf" / "tiny.yaml"), f"serve.model={model}",
                  f"serve.port={port}", f"serve.trace_root={root}", "engine.max_model_len=2048"], tmp / "server.log", env)
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(0)
    kinds: dict[str, list] = {"cold": [], "warm": [], "warm_prefix_new_suffix": []}
    try:
        wait(url, proc, tmp / "server.log")
        asyncio.run(ttft(url, [rng.randrange(10, 400) for _ in range(64)]))
        for _ in range(a.repeats):
            p = [rng.randrange(10, 400) for _ in range(a.tokens)]
            kinds["cold"].append(asyncio.run(ttft(url, p)))
            kinds["warm"].append(asyncio.run(ttft(url, p)))
            kinds["warm_prefix_new_suffix"].append(asyncio.run(ttft(url, p[:-64] + [rng.randrange(10, 400) for _ in range(64)])))
        httpx.post(url + "/admin/flush", headers={"authorization": "Bearer bench"}, timeout=60).raise_for_status()
        rows = {r["trace_id"]: r for r in read_traces(root).to_pylist()}
    finally:
        stop(proc)
    print(json.dumps({k: {"ttft_ms_median": statistics.median(x[0] for x in v),
                          "cached_prompt_tokens_median": statistics.median(rows[x[1]]["num_cached_prompt_tokens"] for x in v)}
                      for k, v in kinds.items()} | {"prompt_tokens": a.tokens}, indent=2))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
