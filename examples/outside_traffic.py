"""Production-like traffic from outside the loop: each calculator problem played ONCE, a thumbs-up
or thumbs-down posted per episode (right answer = up), round after round, until stopped.

    ./fw loop serve conf/agent_rl.yaml &                          # the endpoint (port 8000)
    ./fw python examples/outside_traffic.py --url http://127.0.0.1:8000 --tokenizer MODEL_DIR &
    ./fw loop run conf/agent_rl.yaml collect.source=traffic collect.endpoint=http://127.0.0.1:8000

What the loop sees is what a deployed agent's users leave: one episode per prompt (no GRPO groups:
`trainer.adv_estimator: auto` picks REINFORCE++), a rating and no reward (`dataset.rating_range`
maps thumbs -1/+1 to 0/1). By default the episodes are played by the project's HTTP collector with
`group_size=1` (token-id prompts, so nothing is re-tokenized); its own reward posting is off.
`--agent examples/agents_sdk_calculator.py:play` plays them with a framework agent instead (the
OpenAI Agents SDK: text messages and tools, re-sent each turn), through the client the plugin
runner hands it; the agent's reward stays here and only the thumbs reach the server.
Problems come from the train split with seeds `--seed`, `--seed + 1`, ...: never the eval pool.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def post_ratings(url: str, rows: list[tuple[str, str, bool]]) -> int:
    """`rows`: (trace_id, episode_id, up): one thumbs-up or -down per episode, from its user."""
    import httpx

    rows = [{"trace_id": t, "episode_id": e, "rating": 1 if up else -1, "source": "user"} for t, e, up in rows]
    async with httpx.AsyncClient(timeout=60) as http:
        for at in range(0, len(rows), 500):
            resp = await http.post(url.rstrip("/") + "/v1/feedback", json=rows[at:at + 500])
            resp.raise_for_status()
    return len(rows)


async def collector_round(url: str, problems, tok) -> list[tuple[str, str, bool]]:
    from rollout.collector import CollectorConfig, collect
    from rollout.tasks.calculator import TASK

    cfg = CollectorConfig(base_url=url, group_size=1, post_feedback=False, concurrency=32, progress=False)
    results, _ = await collect(problems, tok, cfg, TASK)
    return [(r.turns[-1].trace_id, r.episode_id, r.reward > 0) for r in results
            if r.status == "ok" and r.turns and r.turns[-1].trace_id]


async def agent_round(url: str, problems, spec: str) -> list[tuple[str, str, bool]]:
    """The framework agent plays each problem once through the plugin runner's tagged client; its
    reward is kept here (the episode stays pending at the server) and becomes the user's thumbs."""
    from rollout.agents import AgentRunConfig, load_agent, run_agent

    play, outcome = load_agent(spec), {}

    async def user(task: dict, client) -> None:
        outcome[task["id"]] = await play(task, client)
        return None

    tasks = [{"id": p.id, "question": p.question, "answer": p.answer} for p in problems]
    episodes = await run_agent(user, tasks, AgentRunConfig(base_url=url, group_size=1, concurrency=32))
    return [(e.trace_ids[-1], e.episode_id, bool(outcome.get(tasks[e.task]["id"]))) for e in episodes
            if e.status == "pending" and e.trace_ids]


def main() -> None:
    from transformers import AutoTokenizer

    from rollout.tasks.calculator import make_problems

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--tokenizer", help="the served model's folder (its tokenizer; the built-in collector's)")
    p.add_argument("--agent", help="'file.py:function' or 'module:function': a task.agent plugin plays instead")
    p.add_argument("--per-round", type=int, default=64, help="problems per round, each played once")
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=0, help="0: until stopped")
    p.add_argument("--pause-s", type=float, default=0.0, help="between rounds")
    a = p.parse_args()
    if not a.agent and not a.tokenizer:
        p.error("--tokenizer is needed unless --agent plays")
    tok = None if a.agent else AutoTokenizer.from_pretrained(a.tokenizer)
    k, up, total = 0, 0, 0
    while not a.rounds or k < a.rounds:
        problems = make_problems("train", a.per_round, seed=a.seed + k)
        try:
            rows = asyncio.run(agent_round(a.url, problems, a.agent) if a.agent else collector_round(a.url, problems, tok))
            n = asyncio.run(post_ratings(a.url, rows))
        except Exception as e:  # the endpoint restarting or swapping: try the next round
            print(f"[traffic] round {k}: {type(e).__name__}: {e}", flush=True)
            time.sleep(2)
            k += 1
            continue
        up += sum(1 for *_, good in rows if good)
        total += n
        print(f"[traffic] round {k}: {n} episodes rated, thumbs up so far {up}/{total}", flush=True)
        k += 1
        time.sleep(a.pause_s)


if __name__ == "__main__":
    main()
