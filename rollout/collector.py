"""The agent rollout collector: plays a task's episodes against the serving endpoint.

    results, stats = collect(problems, tokenizer, CollectorConfig(base_url="http://127.0.0.1:8000"), task)

Each problem is played `group_size` times (a GRPO group), each episode as in `rollout.episode`,
but over HTTP: `POST /v1/completions` with token-id prompts, so turn k+1's prompt is exactly turn
k's prompt + the sampled ids + the rendered tool results (from the episode's own
environment, `task.env`), and nothing is re-tokenized. Sampling is
top-p 1 and no top-k, so the logged logprobs are those of the sampling distribution. Every request
carries `episode_id`/`turn` (and the episode id as `X-Session-ID`, so a router that hashes it,
vllm-router's consistent_hash, keeps every turn of an episode on one replica and its prefix cache); the episodes' rewards go to `POST /v1/feedback` (each on its last
turn's trace, with `episode_id`; one array per group, once the group has finished), so the trace
store holds everything the dataset build needs.

Failure handling (the invariants the dataset build relies on):
- a failed request (connection error, timeout, 429, 5xx) is retried with the same episode_id and
  turn; the server logs every attempt, and the dataset keeps the latest attempt of each turn, the
  one this client continued from (`duplicate_turn` counts the others);
- an episode that runs past `episode_timeout_s`, whose retries run out (its group's feedback
  post included), or whose reply is malformed, is abandoned: it gets no reward, and (best effort)
  an `abandoned` feedback row on its episode_id withdraws what the server traced of it from
  training, whatever the build's reward function;
- every feedback row carries a `feedback_id` derived from its episode, so a retried post cannot
  add a second row (the server and the readers dedup on it);
- each (problem, sample) yields exactly one `EpisodeResult`, ok or not: nothing is counted twice,
  and no episode's failure stops the others.
"""

from __future__ import annotations

import asyncio
import logging
import json
import random
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Literal

import aiohttp

from rollout.chat import ChatFormat
from rollout.episode import after_turn, agent_step
from rollout.tasks import Problem, Task
from rollout.traces.feedback import ABANDONED

RETRY_STATUS = (429, 500, 502, 503, 504)


log = logging.getLogger("flywheel.collector")


@dataclass
class CollectorConfig:
    base_url: str | None = None  # e.g. "http://127.0.0.1:8000"; required to collect (the loop fills it in)
    model: str = "flywheel"
    group_size: int = 8  # G samples per problem
    temperature: float = 1.0
    max_tokens: int | None = None  # per turn; None: the task's
    max_turns: int | None = None  # None: the task's
    concurrency: int = 32  # episodes in flight
    episode_timeout_s: float = 120.0
    request_timeout_s: float = 60.0
    max_retries: int = 3  # per request
    retry_backoff_s: float = 0.2  # doubled per retry, with jitter; a 429's Retry-After wins
    post_feedback: bool = True
    feedback_source: str | None = None  # None: the task's (e.g. "env:calculator")
    progress: bool = True
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])  # prefixes episode ids

    def __post_init__(self):
        if self.base_url is not None and (not isinstance(self.base_url, str)
                                          or not self.base_url.startswith(("http://", "https://"))):
            raise ValueError(f"base_url must be an http(s) URL, got {self.base_url!r}")
        for name in ("group_size", "max_tokens", "max_turns", "concurrency"):
            v = getattr(self, name)
            if v is None and name in ("max_tokens", "max_turns"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {self.max_retries!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (GRPO samples), got {self.temperature}")
        for name in ("episode_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.retry_backoff_s >= 0:
            raise ValueError(f"retry_backoff_s must be >= 0, got {self.retry_backoff_s}")


@dataclass
class TurnResult:
    """One served request as the client received it."""

    prompt_ids: list[int]
    token_ids: list[int]  # sampled, including the closing end-of-turn token when the turn stopped
    logprobs: list[float]  # behaviour logprob of each sampled token
    finish_reason: str
    trace_id: str | None  # x-flywheel-trace-id
    weight_version: int | None  # x-flywheel-weight-version
    attempts: int  # 1 + retries


@dataclass
class EpisodeResult:
    episode_id: str
    group: int  # index of the problem in `collect`'s input
    problem: Problem
    messages: list[dict]
    turns: list[TurnResult] = field(default_factory=list)
    reward: float | None = None  # None unless status is "ok"
    status: Literal["ok", "timeout", "error"] = "ok"
    error: str | None = None


@dataclass(frozen=True)
class CollectStats:
    episodes: int
    episodes_ok: int
    episodes_failed: int
    requests: int  # HTTP attempts (completions and feedback), retries included
    retries: int
    tokens_sampled: int
    seconds: float

    @property
    def episodes_per_s(self) -> float:
        return self.episodes / self.seconds if self.seconds > 0 else 0.0


class RequestFailed(Exception):
    pass


async def collect(problems: list[Problem], tokenizer, cfg: CollectorConfig, task: Task,
                  session: aiohttp.ClientSession | None = None) -> tuple[list[EpisodeResult], CollectStats]:
    """Play `cfg.group_size` episodes of every problem of `task`; results are in (problem, sample) order.

    The HTTP client is aiohttp: measured against the server, 0.25 ms of client CPU per request
    versus httpx's 1.0 ms, and on a small machine the client shares cores with the engine.
    """
    if cfg.base_url is None:
        raise ValueError("CollectorConfig.base_url: no endpoint to collect from")
    own = session is None
    if own:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=cfg.concurrency),
                                        timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s))
    counters = {"requests": 0, "retries": 0}
    chat = ChatFormat.of(tokenizer, task.tools)
    cfg = replace(cfg, max_turns=cfg.max_turns or task.max_turns, max_tokens=cfg.max_tokens or task.max_tokens,
                  feedback_source=cfg.feedback_source or task.feedback_source)
    sem = asyncio.Semaphore(cfg.concurrency)
    results = [EpisodeResult(f"{cfg.run_id}-{g}-{s}", g, p, p.messages())
               for g, p in enumerate(problems) for s in range(cfg.group_size)]
    bar = _progress(len(results), cfg.progress)
    t0 = time.perf_counter()

    left = [cfg.group_size] * len(problems)  # episodes of each group still playing
    finished: list[list[EpisodeResult]] = [[] for _ in problems]  # ok episodes awaiting their group

    group_eps: list[list[EpisodeResult]] = [[] for _ in problems]

    async def one(ep: EpisodeResult) -> None:
        async with sem:  # a slot per episode while it samples
            try:
                await asyncio.wait_for(_play(ep, session, chat, task, cfg, counters), cfg.episode_timeout_s)
            except asyncio.TimeoutError:
                ep.status, ep.error = "timeout", f"episode ran past {cfg.episode_timeout_s} s"
            except RequestFailed as e:
                ep.status, ep.error = "error", str(e)
            except Exception as e:  # a bug or a reply nobody foresaw: this episode only
                ep.status, ep.error = "error", f"{type(e).__name__}: {e}"
        if ep.status == "ok":
            finished[ep.group].append(ep)
        group_eps[ep.group].append(ep)
        left[ep.group] -= 1
        if left[ep.group] == 0 and cfg.post_feedback:
            # the group's rewards in one request, after the slots are freed: feedback waits on the
            # feedback table's commit, not the engine (posting feedback at all cost ~13% of
            # episodes/s on 2 cores: an A/B with it on and off against one server)
            if finished[ep.group]:
                await _post_rewards(session, cfg, finished[ep.group], counters)
            await _withdraw([e for e in group_eps[ep.group] if e.status != "ok"], session, cfg, counters)
        bar.update(1)

    try:
        await asyncio.gather(*(one(ep) for ep in results))
    finally:
        bar.close()
        if own:
            await session.close()
    for ep in results:
        if ep.status != "ok":
            ep.reward = None
    ok = sum(ep.status == "ok" for ep in results)
    stats = CollectStats(episodes=len(results), episodes_ok=ok, episodes_failed=len(results) - ok,
                         requests=counters["requests"], retries=counters["retries"],
                         tokens_sampled=sum(len(t.token_ids) for ep in results for t in ep.turns),
                         seconds=time.perf_counter() - t0)
    return results, stats


def collect_sync(problems: list[Problem], tokenizer, cfg: CollectorConfig, task: Task
                 ) -> tuple[list[EpisodeResult], CollectStats]:
    return asyncio.run(collect(problems, tokenizer, cfg, task))


async def _play(ep: EpisodeResult, client: aiohttp.ClientSession, chat: ChatFormat, task: Task, cfg: CollectorConfig,
                counters) -> None:
    prompt = chat.prompt(ep.problem.messages())
    env = task.env(ep.problem)
    for turn in range(cfg.max_turns):
        t = await _complete(client, cfg, prompt, ep.episode_id, turn, counters)
        ep.turns.append(t)
        msg, results = agent_step(chat, env, t.token_ids, t.finish_reason)
        ep.messages.append(msg)
        if results is None:
            break
        ep.messages, more = after_turn(chat, ep.messages, results)
        prompt = prompt + t.token_ids + more
    ep.reward = task.reward(ep.problem, ep.messages)


async def _complete(client: aiohttp.ClientSession, cfg: CollectorConfig, prompt: list[int], episode_id: str, turn: int,
                    counters) -> TurnResult:
    body = {"model": cfg.model, "prompt": prompt, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
            "top_p": 1.0, "top_k": 0, "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False,
            "episode_id": episode_id, "turn": turn}
    r, attempts = await _post(client, cfg, "/v1/completions", body, counters, {"x-session-id": episode_id})
    try:
        choice = r.json()["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        lps = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise RequestFailed(f"turn {turn}: malformed reply ({type(e).__name__}: {e}): {r.body[:200]!r}") from None
    if len(lps) != len(ids):
        raise RequestFailed(f"turn {turn}: {len(lps)} logprobs for {len(ids)} tokens")
    version = r.headers.get("x-flywheel-weight-version")
    return TurnResult(prompt_ids=list(prompt), token_ids=ids, logprobs=lps,
                      finish_reason="stop" if choice.get("finish_reason") == "stop" else "length",
                      trace_id=r.headers.get("x-flywheel-trace-id"),
                      weight_version=int(version) if version is not None else None, attempts=attempts)


async def _post_rewards(client: aiohttp.ClientSession, cfg: CollectorConfig, episodes: list[EpisodeResult],
                        counters) -> None:
    """The episodes' rewards to /v1/feedback, one array (on each last turn's trace, with episode_id);
    if it cannot be posted, the episodes are abandoned like any failed one."""
    body = [{"trace_id": ep.turns[-1].trace_id, "episode_id": ep.episode_id, "reward": ep.reward,
             "source": cfg.feedback_source, "feedback_id": feedback_id(ep.episode_id, cfg.feedback_source)}
            for ep in episodes]
    try:
        await _post(client, cfg, "/v1/feedback", body, counters)
    except RequestFailed as e:
        for ep in episodes:
            ep.status, ep.error, ep.reward = "error", str(e), None


async def _withdraw(episodes: list[EpisodeResult], client: aiohttp.ClientSession, cfg: CollectorConfig,
                    counters) -> None:
    """Best effort: an `abandoned` feedback row per episode given up on, so a dataset build drops
    whatever turns of it the server traced (the client may not know them all)."""
    if not episodes:
        return
    body = [{"trace_id": (ep.turns[-1].trace_id if ep.turns and ep.turns[-1].trace_id else f"episode:{ep.episode_id}"),
             "episode_id": ep.episode_id, "source": ABANDONED, "comment": (ep.error or ep.status)[:500],
             "feedback_id": feedback_id(ep.episode_id, ABANDONED)} for ep in episodes]
    try:
        await _post(client, cfg, "/v1/feedback", body, counters)
    except RequestFailed:
        pass  # the server is unreachable: nothing more this client can do


def feedback_id(episode_id: str, source: str) -> str:
    """The idempotency key of an episode's feedback from `source`: the same on every retry."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"flywheel:feedback:{episode_id}:{source}").hex


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self):
        return json.loads(self.body)


async def _post(client: aiohttp.ClientSession, cfg: CollectorConfig, path: str, body: dict | list, counters,
                headers: dict[str, str] | None = None) -> tuple[Reply, int]:
    """POST with retries of transport errors, timeouts, 429 and 5xx; other 4xx fail at once."""
    url = cfg.base_url.rstrip("/") + path
    last = ""
    for attempt in range(cfg.max_retries + 1):
        if attempt:
            counters["retries"] += 1
        counters["requests"] += 1
        wait = cfg.retry_backoff_s * 2 ** attempt * (0.5 + random.random())
        try:
            async with client.post(url, json=body, headers=headers) as resp:
                r = Reply(resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.read())
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            last = f"{type(e).__name__}: {e}"
        else:
            if r.status == 200:
                return r, attempt + 1
            last = f"HTTP {r.status}: {r.body[:200].decode(errors='replace')}"
            if r.status not in RETRY_STATUS:
                break
            if r.status == 429 and r.headers.get("retry-after", "").replace(".", "", 1).isdigit():
                wait = float(r.headers["retry-after"])
        if attempt < cfg.max_retries:
            log.info("retrying %s (attempt %d): %s", path, attempt + 1, last)
            await asyncio.sleep(wait)
    raise RequestFailed(f"{path}: {last}")


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="episodes", unit="ep", smoothing=0.1)
