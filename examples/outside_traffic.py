"""Production-like traffic from outside the loop: each calculator problem played ONCE, a thumbs-up
or thumbs-down posted per episode (right answer = up), round after round, until stopped.

    ./fw loop serve conf/agent_rl.yaml &                          # the endpoint (port 8000)
    ./fw python examples/outside_traffic.py --url http://127.0.0.1:8000 --tokenizer MODEL_DIR &
    ./fw loop run conf/agent_rl.yaml collect.source=traffic collect.endpoint=http://127.0.0.1:8000

What the loop sees is what a deployed agent's users leave: one episode per prompt (no GRPO groups:
`trainer.adv_estimator: auto` picks REINFORCE++), a rating and no reward (`dataset.rating_range`
maps thumbs -1/+1 to 0/1). The episodes are played by the project's HTTP collector with
`group_size=1` (token-id prompts, so nothing is re-tokenized); its own reward posting is off.
Problems come from the train split with seeds `--seed`, `--seed + 1`, ...: never the eval pool.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def post_ratings(url: str, results) -> int:
    import httpx

    rows = [{"trace_id": r.turns[-1].trace_id, "episode_id": r.episode_id, "rating": 1 if r.reward > 0 else -1,
             "source": "user"} for r in results if r.status == "ok" and r.turns and r.turns[-1].trace_id]
    async with httpx.AsyncClient(timeout=60) as http:
        for at in range(0, len(rows), 500):
            resp = await http.post(url.rstrip("/") + "/v1/feedback", json=rows[at:at + 500])
            resp.raise_for_status()
    return len(rows)


def main() -> None:
    from transformers import AutoTokenizer

    from rollout.collector import CollectorConfig, collect
    from rollout.tasks.calculator import TASK, make_problems

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--tokenizer", required=True, help="the served model's folder (its tokenizer)")
    p.add_argument("--per-round", type=int, default=64, help="problems per round, each played once")
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=0, help="0: until stopped")
    p.add_argument("--pause-s", type=float, default=0.0, help="between rounds")
    a = p.parse_args()
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    k, up, total = 0, 0, 0
    while not a.rounds or k < a.rounds:
        problems = make_problems("train", a.per_round, seed=a.seed + k)
        cfg = CollectorConfig(base_url=a.url, group_size=1, post_feedback=False, concurrency=32, progress=False)
        try:
            results, _ = asyncio.run(collect(problems, tok, cfg, TASK))
            n = asyncio.run(post_ratings(a.url, results))
        except Exception as e:  # the endpoint restarting or swapping: try the next round
            print(f"[traffic] round {k}: {type(e).__name__}: {e}", flush=True)
            time.sleep(2)
            k += 1
            continue
        up += sum(1 for r in results if r.status == "ok" and r.reward > 0)
        total += n
        print(f"[traffic] round {k}: {n} episodes rated, thumbs up so far {up}/{total}", flush=True)
        k += 1
        time.sleep(a.pause_s)


if __name__ == "__main__":
    main()
