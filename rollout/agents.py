"""Your agent as the loop's collector: `task.agent: "module:function"` (or "path/to/file.py:function").

    async def play(task: dict, client: openai.AsyncOpenAI) -> float | None:
        reply = await client.chat.completions.create(model="flywheel", messages=[...])
        return 1.0 if task["answer"] in reply.choices[0].message.content else 0.0

The agent receives one task (a row of the task source) and an OpenAI client already pointed at the
endpoint and tagged for this episode: every request it makes carries the episode id and its turn
number (headers `x-flywheel-episode-id`, `x-flywheel-turn`), so the server traces the episode under
one id whatever the agent does; its code changes nothing but taking the client it is given. It
returns the episode's reward, or None when the reward comes later (`/v1/feedback`, a reward_fn).

`run_agent` plays each task `group_size` times concurrently (ids `<run>-<task>-<sample>`: a group
per task and round, as the dataset build reads them). An agent that raises, runs past
`episode_timeout_s`, makes no request or returns anything but a finite number or None gets its
episode abandoned with the reason: an `abandoned` feedback row withdraws what the server traced of
it, and nothing else is lost. Rewards the agent returned go to `/v1/feedback` on the episode's last
trace, each with an idempotency key.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx

from rollout.traces.feedback import ABANDONED

AgentFn = Callable[[dict, object], Awaitable["float | None"]]


def load_agent(spec: str) -> AgentFn:
    """Import "package.module:function" or "path/to/file.py:function"; it must be an async function."""
    module, sep, name = spec.rpartition(":")
    if not sep or not module or not name:
        raise ValueError(f"task.agent: expected 'module:function' or 'file.py:function', got {spec!r}")
    if module.endswith(".py"):
        path = Path(module).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"task.agent: {path} is not a file")
        mod_name = f"flywheel_agent_{path.stem}_{uuid.uuid5(uuid.NAMESPACE_URL, str(path)).hex[:8]}"
        loader = importlib.util.spec_from_file_location(mod_name, path)
        mod = importlib.util.module_from_spec(loader)
        sys.modules[mod_name] = mod
        try:
            loader.loader.exec_module(mod)
        except Exception as e:
            raise ValueError(f"task.agent: {path} fails to import: {type(e).__name__}: {e}") from None
    else:
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"task.agent: cannot import {module!r}: {e}") from None
    fn = getattr(mod, name, None)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"task.agent: {spec!r} is not an async function (async def {name}(task, client))")
    return fn


@dataclass
class AgentRunConfig:
    base_url: str
    group_size: int = 8
    concurrency: int = 32  # episodes in flight
    episode_timeout_s: float = 120.0
    request_timeout_s: float = 60.0
    max_retries: int = 3  # the openai client's own retries (same episode id and turn: the dataset keeps the last)
    api_key: str = "unused"
    feedback_source: str = "env:agent"
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])


@dataclass
class AgentEpisode:
    episode_id: str
    task: int  # index into the tasks
    sample: int
    status: Literal["ok", "pending", "abandoned"]
    reward: float | None = None
    reason: str | None = None  # why it was abandoned
    trace_ids: list[str] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)  # x-flywheel-weight-version of each response
    seconds: float = 0.0


class _Tagged:
    """One episode's view of the shared connection pool: every request gets the episode id and its
    turn number; every response's trace id is kept."""

    def __init__(self, episode_id: str):
        self.episode_id, self.turn, self.trace_ids, self.versions = episode_id, 0, [], []

    async def on_request(self, request: httpx.Request) -> None:
        if request.url.path.endswith(("/chat/completions", "/completions")):
            # the openai client's own retry of a request (a 429, a 5xx, a timeout) is the same turn
            # again: the dataset keeps its latest attempt (a new number would leave a gap: missing_turn)
            if request.headers.get("x-stainless-retry-count", "0") != "0" and self.turn > 0:
                self.turn -= 1
            request.headers["x-flywheel-episode-id"] = self.episode_id
            request.headers["x-session-id"] = self.episode_id  # a router's key: one episode, one replica
            request.headers["x-flywheel-turn"] = str(self.turn)
            self.turn += 1

    async def on_response(self, response: httpx.Response) -> None:
        if trace_id := response.headers.get("x-flywheel-trace-id"):
            self.trace_ids.append(trace_id)
        if (version := response.headers.get("x-flywheel-weight-version")) is not None:
            self.versions.append(int(version))


def _client(cfg: AgentRunConfig, transport: httpx.AsyncBaseTransport, tag: _Tagged):
    import openai

    http = httpx.AsyncClient(transport=transport, timeout=cfg.request_timeout_s,
                             event_hooks={"request": [tag.on_request], "response": [tag.on_response]})
    return openai.AsyncOpenAI(base_url=cfg.base_url.rstrip("/") + "/v1", api_key=cfg.api_key, http_client=http,
                              max_retries=cfg.max_retries)


def _reward(value) -> tuple[float | None, str | None]:
    """(reward, None) for a finite number or None; (None, why) for anything else."""
    if value is None:
        return None, None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None, f"the agent returned {value!r:.80}, not a finite number or None"
    return float(value), None


async def _play(agent: AgentFn, task: dict, i: int, s: int, cfg: AgentRunConfig, transport) -> AgentEpisode:
    eid = f"{cfg.run_id}-{i}-{s}"
    tag = _Tagged(eid)
    client = _client(cfg, transport, tag)
    t0 = time.perf_counter()
    try:
        value = await asyncio.wait_for(agent(dict(task), client), cfg.episode_timeout_s)
    except asyncio.TimeoutError:
        ep = AgentEpisode(eid, i, s, "abandoned", reason=f"timed out after task.episode_timeout_s {cfg.episode_timeout_s:g}s")
    except Exception as e:  # the agent's own failure: its episode, nothing else
        ep = AgentEpisode(eid, i, s, "abandoned", reason=f"the agent raised {type(e).__name__}: {str(e)[:300]}")
    else:
        reward, why = _reward(value)
        ep = AgentEpisode(eid, i, s, "abandoned" if why else ("ok" if reward is not None else "pending"), reward, why)
    ep.trace_ids, ep.weight_versions, ep.seconds = tag.trace_ids, tag.versions, round(time.perf_counter() - t0, 3)
    if not ep.trace_ids and ep.status != "abandoned":
        ep.status, ep.reward, ep.reason = "abandoned", None, "the agent made no request through the client it was given"
    return ep


async def run_agent(agent: AgentFn, tasks: list[dict], cfg: AgentRunConfig) -> list[AgentEpisode]:
    """Every task `group_size` times; results in (task, sample) order. Rewards and abandonments
    reach `/v1/feedback` before it returns."""
    transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=cfg.concurrency))
    gate = asyncio.Semaphore(cfg.concurrency)

    async def one(i: int, s: int) -> AgentEpisode:
        async with gate:
            return await _play(agent, tasks[i], i, s, cfg, transport)

    try:
        episodes = await asyncio.gather(*(one(i, s) for i in range(len(tasks)) for s in range(cfg.group_size)))
        await _post_feedback(episodes, cfg, transport)
    finally:
        await transport.aclose()
    return list(episodes)


async def _post_feedback(episodes: list[AgentEpisode], cfg: AgentRunConfig, transport) -> None:
    from rollout.collector import feedback_id

    rows = [{"trace_id": ep.trace_ids[-1], "episode_id": ep.episode_id, "reward": ep.reward, "source": cfg.feedback_source,
             "feedback_id": feedback_id(ep.episode_id, cfg.feedback_source)} for ep in episodes if ep.status == "ok"]
    rows += [{"trace_id": ep.trace_ids[-1] if ep.trace_ids else f"episode:{ep.episode_id}", "episode_id": ep.episode_id,
              "source": ABANDONED, "comment": ep.reason, "feedback_id": feedback_id(ep.episode_id, ABANDONED)}
             for ep in episodes if ep.status == "abandoned"]
    from rollout.server.routes import MAX_FEEDBACK_BATCH

    http = httpx.AsyncClient(transport=transport, timeout=cfg.request_timeout_s)  # closed with the transport
    for at in range(0, len(rows), MAX_FEEDBACK_BATCH):
        r = await http.post(cfg.base_url.rstrip("/") + "/v1/feedback", json=rows[at:at + MAX_FEEDBACK_BATCH],
                            headers={"authorization": f"Bearer {cfg.api_key}"})
        if r.status_code != 200:
            raise RuntimeError(f"POST /v1/feedback: {r.status_code} {r.text[:300]}")
