"""The loop's `collect` and `build_dataset` phases: traffic through the endpoint -> an RL dataset.

    collect:       `collect.source: collector`: through the cycle's endpoint (`loop serve` in a
                   child process, or `collect.endpoint`), play `num_problems` x
                   `rollout.group_size` episodes of `task.name` over HTTP (rollout/collector.py); the
                   server traces every request and the rewards arrive as feedback.
                   `collect.source: traffic`: play nothing; wait until `min_episodes` episodes
                   that the serving version served since the last cycle's window have a reward or
                   a rating (other clients' production traffic, `/v1/feedback`), at most
                   `max_wait_s`, then take that window. Too few: the cycle is skipped, said so,
                   nothing half done (NoTraffic). -> CollectManifest
    build_dataset: the traces of the window the collection wrote (its UTC dates and the weight
                   versions that served it) -> an RL dataset (pipelines/traces_to_dataset.py).
                   Other traffic in that window (live users with feedback) is in it too: the
                   collector is only one client of the endpoint.
"""

from __future__ import annotations

import uuid
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Literal

from loop.configs import to_yaml
from pipelines.rewards import DEFAULT_REWARD_FN, FeedbackMode
from rollout.collector import CollectorConfig


def _collector_defaults() -> CollectorConfig:
    return CollectorConfig(concurrency=64)  # the endpoint is the loop's: its child server or `endpoint`


@dataclass
class CollectConfig:
    """What to collect; `rollout` is the collector's own config (rollout.collector.CollectorConfig,
    checked by itself). Its base_url and run_id are the phase's: the endpoint it collects from, and
    a fresh run id per collection (values set in the config are replaced)."""

    endpoint: str | None = None  # a server already serving the policy into serve.trace_root; None: start one
    source: Literal["collector", "traffic"] = "collector"  # the loop's own episodes, or what users sent
    num_problems: int = 64  # problems of the task's train split
    problem_seed: int = 1
    rollout: CollectorConfig = field(default_factory=_collector_defaults)
    # source: traffic. A cycle waits for min_episodes rewarded episodes, polling every poll_s, at most max_wait_s
    min_episodes: int = 64
    max_episodes: int | None = None  # the window ends after the first this many (None: all that came)
    max_wait_s: float = 600.0
    poll_s: float = 5.0
    # episodes served by up to this many weight versions before the serving one count too (0: only
    # the serving one's). Production traffic keeps coming while a cycle trains: with 1, what the
    # previous version served meanwhile is trained on, importance-corrected against the behaviour
    # logprobs it was sampled with (trainer.rollout_is), instead of waiting for fresh traffic.
    max_staleness: int = 0

    def __post_init__(self):
        if self.source not in ("collector", "traffic"):
            raise ValueError(f"source must be collector or traffic, got {self.source!r}")
        if isinstance(self.min_episodes, bool) or not isinstance(self.min_episodes, int) or self.min_episodes < 2:
            raise ValueError(f"min_episodes must be an int >= 2, got {self.min_episodes!r}")
        if self.max_episodes is not None and self.max_episodes < self.min_episodes:
            raise ValueError(f"max_episodes must be >= min_episodes or null, got {self.max_episodes}")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {self.max_staleness!r}")
        if not (self.max_wait_s >= 0 and self.poll_s > 0):
            raise ValueError(f"max_wait_s must be >= 0 and poll_s > 0, got {self.max_wait_s}, {self.poll_s}")
        if self.endpoint is not None and not str(self.endpoint).startswith(("http://", "https://")):
            raise ValueError(f"endpoint must be an http(s) URL or null, got {self.endpoint!r}")
        if isinstance(self.num_problems, bool) or not isinstance(self.num_problems, int) or self.num_problems < 1:
            raise ValueError(f"num_problems must be an int >= 1, got {self.num_problems!r}")

    def collector(self, base_url: str) -> CollectorConfig:
        """The collector's config for one collection: its endpoint, and a fresh run id (episode
        ids are `<run>-<problem>-<sample>`: every collection is a round of its own)."""
        return replace(self.rollout, base_url=base_url, run_id=uuid.uuid4().hex[:8])


@dataclass
class DatasetPhaseConfig:
    heldout_fraction: float = 0.1  # of groups, set aside for the KL gate
    heldout_unit: Literal["group", "episode"] = "group"
    # the gate's held-out slice: at least 4 groups (the 10% hash alone drew 0-1 of 64 in ~1% of cycles)
    min_heldout: int = 4
    seed: int = 0  # salts the held-out hash
    reward_fn: str = DEFAULT_REWARD_FN  # "module:function" of an EpisodeRecord
    feedback_mode: FeedbackMode = "override"  # how logged feedback combines with reward_fn
    rating_range: tuple[int, int] = (-1, 1)  # a rating r counts as reward (r - lo) / (hi - lo); stars: [1, 5]

    def __post_init__(self):
        self.dataset(Path("."), Path("."), "checked", "raw_logprobs", "calculator")  # DatasetConfig's checks, at load

    def dataset(self, trace_root: Path, out_dir: Path, tokenizer: str, logprobs_mode: str, task: str,
                dates: tuple[str, ...] | None = None, weight_versions: tuple[int, ...] | None = None,
                since: str | None = None, until: str | None = None):
        from pipelines.traces_to_dataset import DatasetConfig

        return DatasetConfig(trace_root=trace_root, out_dir=out_dir, tokenizer=tokenizer, task=task, dates=dates,
                             weight_versions=weight_versions, since=since, until=until,
                             heldout_fraction=self.heldout_fraction,
                             heldout_unit=self.heldout_unit, min_heldout=self.min_heldout, seed=self.seed, reward_fn=self.reward_fn,
                             feedback_mode=self.feedback_mode, rating_range=self.rating_range,
                             logprobs_mode=logprobs_mode)


@dataclass(frozen=True)
class CollectManifest:
    endpoint: str
    trace_root: str
    run_id: str  # prefixes the episode ids
    dates: tuple[str, ...]  # UTC dates the collection ran on (trace partitions)
    weight_versions: tuple[int, ...]  # served versions seen in the responses
    started_at: str  # ISO-8601 UTC: the dataset reads traces from then on (not an earlier, killed try's)
    episodes: int
    episodes_ok: int
    success: float  # mean task reward of the ok episodes
    group_successes: list[int] = field(default_factory=list)  # per group: episodes rewarded > 0
    requests: int = 0
    retries: int = 0
    tokens_sampled: int = 0
    seconds: float = 0.0
    source: str = "collector"
    until: str | None = None  # ISO-8601 UTC, traffic windows: the dataset reads traces before then

    @classmethod
    def from_dict(cls, d: dict) -> "CollectManifest":
        return cls(**{**d, "dates": tuple(d["dates"]), "weight_versions": tuple(d["weight_versions"])})

    @property
    def episodes_per_s(self) -> float:
        return self.episodes / self.seconds if self.seconds > 0 else 0.0


def _utc_date() -> str:
    return datetime.now(timezone.utc).date().isoformat()


@dataclass(frozen=True)
class Endpoint:
    """The server the cycle talks to: its URL, admin token, and the child process when the loop
    started it (None: `collect.endpoint`, someone else's)."""
    url: str
    admin_token: str | None
    process: object | None = None


@contextmanager
def endpoint(cfg, model: str | Path, run_dir: Path):
    """`collect.endpoint`, or a `loop serve` of `model` on this very config, started for the cycle
    (<run_dir>/logs/serve-cycle.{yaml,log}) and stopped after it."""
    from rollout.server.process import ServerProcess

    if cfg.collect.endpoint:
        yield Endpoint(cfg.collect.endpoint, cfg.serve.resolved_admin_token())
        return
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "serve-cycle.yaml").write_text(to_yaml(cfg))
    # the configured token when there is one (`loop rollback` and the user's scripts reach this
    # server with it), else one of its own; either way passed by environment, never written
    with ServerProcess(logs / "serve-cycle.yaml", model, cfg.serve.trace_root, logs / "serve-cycle.log",
                       admin_token=cfg.serve.resolved_admin_token()) as srv:
        print(f"[loop] serving {model} at {srv.url}, traces to {cfg.serve.trace_root}", flush=True)
        yield Endpoint(srv.url, srv.admin_token, srv)


def collect_phase(cfg, ep: Endpoint, tokenizer_path: str | Path, problem_seed: int | None = None) -> CollectManifest:
    """Play the episodes through the endpoint, then have its traces flushed to Parquet. The
    problems are the task's train split drawn with `problem_seed` (default `collect.problem_seed`)."""
    from transformers import AutoTokenizer

    from rollout.collector import collect_sync
    from rollout.cpu_placement import beside_front_end
    c, task = cfg.collect, cfg.task.load()
    problems = task.problems("train", c.num_problems, seed=c.problem_seed if problem_seed is None else problem_seed)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    started = datetime.now(timezone.utc)
    first_date = started.date().isoformat()
    ccfg = c.collector(ep.url)
    # as the server's client, this process runs on its front-end cores, off the worker's
    near = ep.process is not None and cfg.engine.reserves_front_end()
    with beside_front_end(ep.process.proc.pid) if near else nullcontext():
        results, stats = collect_sync(problems, tokenizer, ccfg, task)
    _flush(ep.url, ep.admin_token)
    ok = [r for r in results if r.status == "ok"]
    groups = [0] * len(problems)
    for r in ok:
        groups[r.group] += int(r.reward > 0)
    versions = sorted({t.weight_version for r in results for t in r.turns if t.weight_version is not None})
    return CollectManifest(
        endpoint=ccfg.base_url, trace_root=str(cfg.serve.trace_root), run_id=ccfg.run_id,
        dates=tuple(sorted({first_date, _utc_date()})), weight_versions=tuple(versions),
        started_at=started.isoformat(), episodes=stats.episodes,
        episodes_ok=stats.episodes_ok, success=sum(r.reward for r in ok) / max(1, len(ok)), group_successes=groups,
        requests=stats.requests, retries=stats.retries, tokens_sampled=stats.tokens_sampled, seconds=stats.seconds)


def agent_collect_phase(cfg, ep: Endpoint, problem_seed: int) -> CollectManifest:
    """`task.agent` plays `collect.num_problems` tasks of `task.source`'s train split (drawn with
    `problem_seed`: fresh tasks each cycle), each `rollout.group_size` times, through the endpoint."""
    import asyncio
    import random

    from rollout.agents import AgentRunConfig, load_agent, run_agent
    from rollout.task_source import load_tasks

    c, r = cfg.collect, cfg.collect.rollout
    tasks = load_tasks(cfg.task.source, "train")
    picked = [tasks[i] for i in random.Random(problem_seed).sample(range(len(tasks)), min(c.num_problems, len(tasks)))]
    run = AgentRunConfig(base_url=ep.url, group_size=r.group_size, concurrency=r.concurrency,
                         episode_timeout_s=r.episode_timeout_s, request_timeout_s=r.request_timeout_s,
                         max_retries=r.max_retries, api_key=cfg.serve.resolved_api_key() or "unused")
    started = datetime.now(timezone.utc)
    episodes = asyncio.run(run_agent(load_agent(cfg.task.agent), picked, run))
    _flush(ep.url, ep.admin_token)
    ok = [e for e in episodes if e.status == "ok"]
    groups = [sum(1 for e in ok if e.task == i and e.reward > 0) for i in range(len(picked))]
    for why in sorted({e.reason for e in episodes if e.status == "abandoned"}):
        n = sum(1 for e in episodes if e.reason == why)
        print(f"[loop] {n} episode(s) abandoned: {why}", flush=True)
    return CollectManifest(
        endpoint=ep.url, trace_root=str(cfg.serve.trace_root), run_id=run.run_id,
        dates=tuple(sorted({started.date().isoformat(), _utc_date()})),
        weight_versions=tuple(sorted({v for e in episodes for v in e.weight_versions})), started_at=started.isoformat(),
        episodes=len(episodes), episodes_ok=len(ok), success=sum(e.reward for e in ok) / max(1, len(ok)),
        group_successes=groups, requests=sum(len(e.trace_ids) for e in episodes),
        seconds=round((datetime.now(timezone.utc) - started).total_seconds(), 2), source="agent")


class NoTraffic(RuntimeError):
    """Too few rewarded episodes reached the endpoint within collect.max_wait_s: the cycle is skipped."""


def traffic_phase(cfg, ep: Endpoint, tokenizer: str, weight_version: int, since: str | None) -> CollectManifest:
    """Wait for `collect.min_episodes` episodes served by `weight_version` (or up to
    `collect.max_staleness` versions before it) since `since` (the last window's end; None: all its
    traffic) with a reward or a rating; the window is theirs."""
    import time

    from pipelines.traces_to_dataset import rewarded_episodes

    c, t0 = cfg.collect, time.monotonic()
    versions = tuple(range(max(0, weight_version - c.max_staleness), weight_version + 1))
    served_by = f"weight version{'s' if len(versions) > 1 else ''} {_span(versions)}"
    while True:
        _flush(ep.url, ep.admin_token)
        until = datetime.now(timezone.utc).isoformat()
        window = cfg.dataset.dataset(Path(cfg.serve.trace_root), Path("."), tokenizer, cfg.serve.logprobs_mode,
                                     cfg.task.name, weight_versions=versions, since=since, until=until)
        found = rewarded_episodes(window)
        waited = time.monotonic() - t0
        if len(found) >= c.min_episodes:
            if c.max_episodes is not None and len(found) > c.max_episodes:  # end the window after the first ones
                until = (found[c.max_episodes - 1][0] + timedelta(microseconds=1)).isoformat()
                found = found[:c.max_episodes]
            break
        if waited >= c.max_wait_s:
            raise NoTraffic(f"{len(found)} of collect.min_episodes {c.min_episodes} episodes served by {served_by} "
                            f"since {since or 'it started'} have a reward or a rating after collect.max_wait_s "
                            f"{c.max_wait_s:g}s: cycle skipped, nothing trained")
        print(f"[loop] waiting for traffic: {len(found)}/{c.min_episodes} rewarded episodes of {served_by} "
              f"({waited:.0f}/{c.max_wait_s:g}s)", flush=True)
        time.sleep(min(c.poll_s, max(0.0, c.max_wait_s - waited)))
    return CollectManifest(
        endpoint=ep.url, trace_root=str(cfg.serve.trace_root), run_id=f"traffic-v{weight_version}-{uuid.uuid4().hex[:6]}",
        dates=(), weight_versions=versions, started_at=since or "", episodes=len(found),
        episodes_ok=len(found), success=sum(r for _, r in found) / len(found), seconds=round(time.monotonic() - t0, 2),
        source="traffic", until=until)


def _span(versions: tuple[int, ...]) -> str:
    return str(versions[0]) if len(versions) == 1 else f"{versions[0]}-{versions[-1]}"


def _flush(endpoint: str, token: str | None) -> None:
    """Ask a server we did not start to convert its traces to Parquet now (its admin API)."""
    import httpx

    if token is None:
        print(f"[loop] no admin token (serve.admin_token_env or serve.admin_token_file): traces {endpoint} has not yet "
              "converted to Parquet will reach a later dataset", flush=True)
        return
    r = httpx.post(endpoint.rstrip("/") + "/admin/flush", headers={"authorization": f"Bearer {token}"}, timeout=120)
    if r.status_code != 200:
        raise RuntimeError(f"POST {endpoint}/admin/flush: {r.status_code} {r.text[:300]}")


def dataset_phase(cfg, collected: CollectManifest, tokenizer: str, run_dir: Path):
    """The collection's trace window -> a new dataset under <run_dir>/datasets/."""
    from pipelines.traces_to_dataset import build_dataset

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = run_dir / "datasets" / f"{stamp}-{collected.run_id}"
    return build_dataset(cfg.dataset.dataset(Path(collected.trace_root), out, tokenizer, cfg.serve.logprobs_mode,
                                             cfg.task.name, dates=collected.dates or None,
                                             weight_versions=collected.weight_versions or None,
                                             since=collected.started_at or None, until=collected.until))


def log_collect(collected: CollectManifest, dataset) -> None:
    """Metrics, both manifests and the group-success histogram into the active MLflow run."""
    import mlflow

    mlflow.log_metrics({
        "collect/episodes": collected.episodes, "collect/episodes_ok": collected.episodes_ok,
        "collect/success": collected.success, "collect/episodes_per_s": collected.episodes_per_s,
        "collect/tokens_per_s": collected.tokens_sampled / max(collected.seconds, 1e-9),
        "collect/requests": collected.requests, "collect/retries": collected.retries,
        "dataset/train_episodes": dataset.train_episodes, "dataset/heldout_episodes": dataset.heldout_episodes,
        "dataset/groups": dataset.groups, "dataset/rows_read": dataset.rows_read,
        "dataset/build_seconds": dataset.build_seconds,
        **{f"dataset/dropped_rows/{k}": v for k, v in dataset.dropped_rows.items()},
        **{f"dataset/dropped_episodes/{k}": v for k, v in dataset.dropped_episodes.items()},
    })
    mlflow.log_dict(asdict(collected), "collect_manifest.json")
    mlflow.log_dict(dataset.to_dict(), "dataset_manifest.json")
    mlflow.set_tag("dataset_path", dataset.path)
    log_dataset_input(dataset)
    if collected.group_successes:  # the loop's own groups (traffic has none it made)
        _plot_groups(collected.group_successes, max(1, collected.episodes // len(collected.group_successes)))


def log_dataset_input(dataset) -> None:
    """The dataset as the run's MLflow input: its source the trace window it was built from (the
    trace root, the weight versions, dates and start time), its digest the dataset manifest's."""
    import warnings

    import mlflow
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    from rollout.artifacts import MANIFEST, file_sha256

    w = dataset.parent
    with warnings.catch_warnings():  # "inferred a LocalArtifactDatasetSource": what is meant here
        warnings.simplefilter("ignore")
        source = resolve_dataset_source((Path(w.trace_root) / "traces").resolve().as_uri())
    versions = ",".join(map(str, w.weight_versions or ())) or "all"
    mlflow.log_input(MetaDataset(source, name=f"traces v{versions}", digest=file_sha256(Path(dataset.path) / MANIFEST)[:16]),
                     context="train", tags={"weight_versions": versions, "dates": ",".join(w.dates or ()) or "all",
                                            "since": w.since or "", "dataset_path": dataset.path,
                                            "episodes": str(dataset.train_episodes + dataset.heldout_episodes)})


def _plot_groups(successes: list[int], group_size: int) -> None:
    """How many GRPO groups had k of G episodes succeed: groups at 0 or G carry no advantage."""
    import tempfile

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import mlflow

    counts = [successes.count(k) for k in range(group_size + 1)]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(range(group_size + 1), counts, color=["#bbb"] + ["#4a7"] * (group_size - 1) + ["#bbb"])
    ax.set(xlabel=f"successful episodes in the group (of {group_size})", ylabel="groups",
           title="GRPO groups by success (grey: no learning signal)")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "group_success.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        mlflow.log_artifact(str(path), artifact_path="plots")
    plt.close(fig)
