"""Traces (and feedback) of a window of dates and weight versions -> an RL dataset artifact.

    manifest = build_dataset(DatasetConfig(trace_root=..., out_dir=..., tokenizer=...))

read (columnar, partition-pruned) -> order episodes and drop bad rows -> per chunk of episodes:
check alignment and build token arrays (vectorized, pipelines/dataset/assemble.py) -> reward
each episode (a plain function, pipelines/rewards.py) -> split held-out by a salted hash ->
write Parquet -> manifest. The dataset's columns are `DATASET_SCHEMA`; what was dropped, and
why, is counted in the manifest.

Invariants: the output directory appears atomically (built in a temporary sibling, then
renamed), with `flywheel_manifest.json` recording every file's sha256; the held-out split depends only on
(seed, group id or episode id), so rebuilding a window, or a larger one, never moves an episode
between train and held-out; an episode's tokens, mask and logprobs are exactly the logged ones.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from collections import Counter, defaultdict
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from pipelines.dataset.assemble import (READ_COLUMNS, EpisodeTokens, TokenColumns, _ranges, assemble, drop_counts,
                                       first_prompts, order_episodes, segments)
from pipelines.dataset.manifest import (DATASET_SCHEMA, DatasetConfig, RLDatasetManifest, TraceWindow,
                                        load_manifest, save_manifest)
from rollout.artifacts import file_sha256
from pipelines.rewards import EpisodeRecord, load_fn, score
from rollout.chat import ChatFormat
from rollout.tasks import load_task
from rollout.traces import Feedback, read_feedback, read_traces
from rollout.traces.feedback import ABANDONED

__all__ = ["DATASET_SCHEMA", "DatasetConfig", "RLDatasetManifest", "build_dataset", "load_manifest"]

SPLITS = ("train", "heldout")


def build_dataset(cfg: DatasetConfig) -> RLDatasetManifest:
    t0 = time.perf_counter()
    if cfg.out_dir.exists():
        raise FileExistsError(f"out_dir {cfg.out_dir} exists; datasets are immutable, pick a new one")
    from transformers import AutoTokenizer

    # the Rust tokenizer's decode: transformers' wrapper type-checks every id (~3x the cost)
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    decode = partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=False)
    task = load_task(cfg.task)
    chat = ChatFormat.of(tokenizer, task.tools)
    reward_fn = load_fn(cfg.reward_fn)

    table = window_traces(cfg, READ_COLUMNS)
    order = order_episodes(table.select([c for c in READ_COLUMNS if "token" not in c and "logprobs" not in c]),
                           cfg.logprobs_mode)
    ep_keys = pc.coalesce(table["episode_id"], table["trace_id"])
    feedback = _feedback_by_episode(cfg, table["trace_id"], ep_keys, pc.min(table["created_at"]).as_py())
    versions = np.asarray(table["weight_version"], dtype=np.int64)
    base = cfg.trainer_base_version if cfg.trainer_base_version is not None else int(versions.max(initial=0))

    tmp = cfg.out_dir.with_name(f".{cfg.out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    writers = {s: _Writer(tmp / s / "part-00000.parquet") for s in SPLITS}
    dropped_episodes = Counter()
    split_counts = Counter()  # episodes with a re-tokenized turn kept as segments, and their rows
    groups: set[str] = set()
    unit_col = "group_id" if cfg.heldout_unit == "group" else "episode_id"
    units: dict[str, bool] = {}  # held-out unit (group or episode id) -> whether the hash held it out
    kept_versions: set[int] = set()
    cols = TokenColumns.of(table)
    trace_ids, created_at = table["trace_id"], table["created_at"]
    for e0, e1 in _chunks(order.starts, cfg.chunk_rows):
        rows = order.rows[order.starts[e0]:order.starts[e1]]
        ep_starts = order.starts[e0:e1 + 1] - order.starts[e0]
        # one segment per episode, but where a client's re-tokenized turn splits it
        starts, seg_ep = segments(cols, rows, ep_starts)
        bad, ep_bad = order.bad[e0:e1][seg_ep], order.bad[e0:e1].copy()
        tokens = assemble(cols, rows, starts, bad)
        for s in np.flatnonzero(bad != None):  # noqa: E711 (object array): a bad segment spoils its episode
            ep_bad[seg_ep[s]] = ep_bad[seg_ep[s]] or bad[s]
        segs = tokens.episodes  # the kept segments
        k_of_seg = dict(zip(segs.tolist(), range(len(segs))))
        first_seg = np.searchsorted(starts, ep_starts)
        ep_keys_chunk = ep_keys.take(rows[ep_starts[:-1]]).to_pylist()
        ids = trace_ids.take(rows).to_pylist()
        ep_rewards = np.full(len(ep_keys_chunk), np.nan)
        for e, key in enumerate(ep_keys_chunk):
            if ep_bad[e] is not None:
                continue
            fbs = feedback.get(key, ())
            if any(f.source == ABANDONED for f in fbs):  # its client gave up on it: not training data
                ep_bad[e] = "abandoned"
                continue
            k = k_of_seg[first_seg[e + 1] - 1]  # the last segment holds the whole conversation as rendered
            record = EpisodeRecord(key, tuple(ids[ep_starts[e]:ep_starts[e + 1]]),
                                   tokens.input_ids[tokens.offsets[k]:tokens.offsets[k + 1]].tolist(), decode,
                                   tuple(fbs), cfg.rating_range, chat, task)
            r = score(record, reward_fn, cfg.feedback_mode)
            if r is None:
                ep_bad[e] = "missing_reward"
            else:
                ep_rewards[e] = r
        dropped_episodes.update(drop_counts(ep_bad))
        rewards = ep_rewards[seg_ep[segs]]
        split = np.diff(first_seg) > 1
        split_counts["split_episodes"] += int((split & ~np.isnan(ep_rewards)).sum())
        split_counts["segment_rows"] += int((np.isin(seg_ep[segs], np.flatnonzero(split)) & ~np.isnan(rewards)).sum())
        out = _episode_table(tokens, cols, rows, starts, seg_ep, ep_starts, ep_keys_chunk, ids, created_at, rewards, base)
        out = out.filter(pa.array(~np.isnan(rewards)))
        if out.num_rows == 0:
            continue
        groups.update(out["group_id"].to_pylist())
        rewarded = starts[segs[~np.isnan(rewards)]]
        kept_versions.update(np.unique(cols.weight_version[rows[_ranges(rewarded, np.diff(starts)[segs[~np.isnan(rewards)]])]]).tolist())
        unit_keys = out[unit_col].to_pylist()
        mask = heldout_mask(unit_keys, cfg.heldout_fraction, cfg.seed)
        units.update(zip(unit_keys, mask))
        held = pa.array(mask)
        writers["train"].write(out.filter(pc.invert(held)))
        writers["heldout"].write(out.filter(held))

    counts = {s: w.close() for s, w in writers.items()}
    if more := topup_heldout(units, cfg):
        counts = _move_to_heldout(tmp, unit_col, more)
    files = {str(p.relative_to(tmp)): file_sha256(p) for p in sorted(tmp.rglob("*.parquet"))}
    manifest = RLDatasetManifest(
        path=str(cfg.out_dir), parent=TraceWindow(str(cfg.trace_root), cfg.dates, cfg.weight_versions, cfg.since,
                                                            cfg.until),
        rows_read=table.num_rows, train_episodes=counts["train"], heldout_episodes=counts["heldout"],
        groups=len(groups), dropped_rows={k: v for k, v in sorted(order.dropped_rows.items())},
        dropped_episodes=dict(sorted(dropped_episodes.items())),
        weight_versions=tuple(sorted(v for v in kept_versions if v >= 0)), trainer_base_version=base,
        reward_fn=cfg.reward_fn, feedback_mode=cfg.feedback_mode, logprobs_mode=cfg.logprobs_mode,
        heldout_fraction=float(cfg.heldout_fraction), heldout_unit=cfg.heldout_unit, min_heldout=cfg.min_heldout,
        seed=cfg.seed, files=files, rating_range=cfg.rating_range, task=cfg.task, **split_counts,
        created_at=datetime.now(timezone.utc).isoformat(), build_seconds=round(time.perf_counter() - t0, 3),
    )
    save_manifest(manifest, tmp)
    os.rename(tmp, cfg.out_dir)
    return manifest


def heldout_mask(keys: list[str], fraction: float, seed: int) -> list[bool]:
    """Whether each key is held out: a salted 64-bit hash below `fraction` of its range.
    Depends on (seed, key) only, so a key never changes side between rebuilds."""
    cut = int(fraction * 2**64)
    return [_unit_hash(k, seed) < cut for k in keys]


def _unit_hash(key: str, seed: int) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8, key=str(seed).encode()).digest(), "little")


def topup_heldout(units: dict[str, bool], cfg: DatasetConfig) -> set[str]:
    """The train units to hold out as well when the hash drew fewer than `cfg.min_heldout` (at most
    half the units): those whose hash lies nearest above the cut, the ones a larger fraction would
    take next. Empty when the draw is enough or heldout_fraction is 0."""
    want = min(cfg.min_heldout, len(units) // 2) if cfg.heldout_fraction > 0 else 0
    held = sum(units.values())
    if held >= want:
        return set()
    train = sorted((k for k, h in units.items() if not h), key=lambda k: _unit_hash(k, cfg.seed))
    return set(train[:want - held])


def _move_to_heldout(tmp: Path, column: str, moved: set[str]) -> dict[str, int]:
    """Rewrite the two split files with the rows of `moved` units in heldout (small datasets only:
    a hash draw of 10% falls short of a few units only when there are few)."""
    paths = {s: tmp / s / "part-00000.parquet" for s in SPLITS}
    tables = {s: pq.read_table(p) for s, p in paths.items()}
    move = pc.is_in(tables["train"][column], value_set=pa.array(sorted(moved), pa.string()))
    out = {"train": tables["train"].filter(pc.invert(move)),
           "heldout": pa.concat_tables([tables["heldout"], tables["train"].filter(move)])}
    counts = {}
    for s, table in out.items():
        paths[s].unlink()
        w = _Writer(paths[s])
        w.write(table)
        counts[s] = w.close()
    return counts


_ROUND = re.compile(r"(.+)-\d+")  # `<round>-<sample>`, whole id


def group_id(first_prompt: bytes, weight_version: int, episode_id: str) -> str:
    """The GRPO group of an episode: episodes that answered the same turn-0 prompt (int32 bytes),
    sampled by the same weight version, in the same collection round. A group that mixed rounds
    or versions would compare rewards of different policies as if they were one.

    The round is the episode id less its sample number: the collector names episodes
    `<run>-<problem>-<sample>` (rollout/collector.py, a fresh run id per collection), so one
    round's G samples of a problem share `<run>-<problem>` and a later round's do not. Traces
    carry no other round key: dates and hours cut rounds that straddle them, and the weight
    version alone merges rounds served by one version. An id that does not end in `-<digits>`
    (another client's, e.g. a uuid) names one episode, not a round: it adds nothing, and such
    episodes group by prompt and version (a round key there would make every group a singleton)."""
    round_key = _ROUND.fullmatch(episode_id)
    h = hashlib.blake2b(first_prompt, digest_size=8)
    h.update(int(weight_version).to_bytes(8, "little", signed=True))
    h.update(round_key[1].encode() if round_key else b"")
    return h.hexdigest()


def _episode_table(tokens: EpisodeTokens, cols: TokenColumns, rows: np.ndarray, starts: np.ndarray,
                   seg_ep: np.ndarray, ep_starts: np.ndarray, ep_keys: list[str], trace_ids: list[str],
                   created_at: pa.ChunkedArray, rewards: np.ndarray, base: int) -> pa.Table:
    """`DATASET_SCHEMA` rows of the kept segments of a chunk (`rows`: its sorted table rows;
    segment s spans rows[starts[s]:starts[s+1]] of episode seg_ep[s], which starts at ep_starts[e])."""
    eps = tokens.episodes  # kept segments
    n_turns = (starts[eps + 1] - starts[eps]).astype(np.int32)
    ver = cols.weight_version[rows]
    min_ver = np.minimum.reduceat(ver, starts[:-1])[eps] if len(eps) else np.zeros(0, np.int64)
    turn_pos = _ranges(starts[eps], n_turns.astype(np.int64))
    off = pa.array(tokens.offsets.astype(np.int32))
    ep = seg_ep[eps]
    first = np.searchsorted(starts, ep_starts)  # each episode's first segment
    keys = [ep_keys[e] for e in ep.tolist()]
    return pa.table({
        "episode_id": pa.array(keys, pa.string()),
        # the group of the episode (its turn 0), whichever segment
        "group_id": pa.array([group_id(b, v, k) for b, v, k in zip(first_prompts(cols, rows[ep_starts[ep]]),
                                                                   cols.weight_version[rows[ep_starts[ep]]].tolist(),
                                                                   keys)], pa.string()),
        "trace_ids": pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(n_turns)]).astype(np.int32)),
                                              pa.array([trace_ids[p] for p in turn_pos.tolist()], pa.string())),
        "num_turns": pa.array(n_turns),
        "prompt_len": pa.array(tokens.first_prompt_len),
        "input_ids": pa.ListArray.from_arrays(off, pa.array(tokens.input_ids)),
        "assistant_mask": pa.ListArray.from_arrays(off, pa.array(tokens.assistant_mask)),
        "behaviour_logprobs": pa.ListArray.from_arrays(off, pa.array(tokens.behaviour_logprobs)),
        "weight_versions": pa.ListArray.from_arrays(off, pa.array(tokens.weight_versions)),
        "temperatures": pa.ListArray.from_arrays(off, pa.array(tokens.temperatures)),
        "reward": pa.array(rewards, pa.float64()),
        "weight_version": pa.array(min_ver),
        "version_lag": pa.array(base - min_ver),
        "created_at": created_at.take(rows[starts[eps]]),
        "segment": pa.array((eps - first[ep]).astype(np.int32)),
        "segments": pa.array((first[ep + 1] - first[ep]).astype(np.int32)),
    }, schema=DATASET_SCHEMA)


def _chunks(starts: np.ndarray, chunk_rows: int):
    """(e0, e1) episode ranges of about `chunk_rows` rows each, never splitting an episode."""
    n_ep = len(starts) - 1
    e0 = 0
    while e0 < n_ep:
        e1 = int(np.searchsorted(starts, starts[e0] + chunk_rows, side="right")) - 1
        e1 = min(max(e1, e0 + 1), n_ep)
        yield e0, e1
        e0 = e1


def window_traces(cfg: DatasetConfig, columns: list[str]) -> pa.Table:
    """The trace rows of the config's window: its dates, weight versions, and since..until."""
    def at(t: str | None) -> datetime | None:
        return None if t is None else datetime.fromisoformat(t)

    return read_traces(cfg.trace_root, dates=cfg.dates, weight_versions=cfg.weight_versions, since=at(cfg.since),
                       until=at(cfg.until), columns=columns)


def rewarded_episodes(cfg: DatasetConfig) -> list[tuple[datetime, float]]:
    """(last trace's time, feedback reward or rating by `cfg.rating_range`) of each episode in the
    window that has one, oldest first: what a traffic-fed cycle waits for before it builds its
    dataset. Cheap: ids and feedback only, no tokens (an episode without feedback may still get a
    reward from `cfg.reward_fn` when the dataset is built)."""
    from pipelines.rewards import rating_reward

    table = window_traces(cfg, ["trace_id", "episode_id", "created_at"])
    if table.num_rows == 0:
        return []
    ep_keys = pc.coalesce(table["episode_id"], table["trace_id"])
    last: dict[str, datetime] = {}  # each episode's last trace (rows come unordered)
    for k, t in zip(ep_keys.to_pylist(), table["created_at"].to_pylist()):
        last[k] = max(last.get(k, t), t)
    out = []
    for key, rows in _feedback_by_episode(cfg, table["trace_id"], ep_keys, pc.min(table["created_at"]).as_py()).items():
        if any(f.source == ABANDONED for f in rows):
            continue
        values = [v for v in (rating_reward(f, cfg.rating_range) for f in rows) if v is not None]
        if values:
            out.append((last[key], values[-1]))
    return sorted(out, key=lambda x: x[0])


def _feedback_by_episode(cfg: DatasetConfig, trace_ids: pa.ChunkedArray, ep_keys: pa.ChunkedArray,
                         first_trace_at: datetime | None) -> dict[str, list[Feedback]]:
    """Feedback rows of the window's episodes, oldest first, keyed by episode (a row's own
    `episode_id`, else that of the trace it names). Only rows naming a trace or an episode of
    the window are read (the scan filters them; partitions dated before the window's first
    trace are not opened: feedback follows its trace), and only those become Python objects."""
    if len(trace_ids) == 0:
        return {}
    first_date = first_trace_at.astimezone(timezone.utc).date() if first_trace_at is not None else None
    wanted = (ds.field("trace_id").isin(pc.unique(trace_ids.combine_chunks()))
              | ds.field("episode_id").isin(pc.unique(ep_keys.combine_chunks())))
    fb = read_feedback(cfg.trace_root, since=first_date, filter=wanted,
                       columns=["feedback_id", "trace_id", "episode_id", "reward", "rating", "comment", "source",
                                "created_at"])
    if fb.num_rows == 0:
        return {}
    link = pa.table({"trace_id": trace_ids, "_ep": ep_keys})
    fb = fb.join(link, "trace_id", join_type="left outer")
    fb = fb.append_column("_key", pc.coalesce(fb["episode_id"], fb["_ep"]))
    fb = fb.filter(pc.is_in(fb["_key"], value_set=pc.unique(ep_keys.combine_chunks())))
    fb = fb.take(pc.sort_indices(fb, [("created_at", "ascending"), ("feedback_id", "ascending")]))
    out: dict[str, list[Feedback]] = defaultdict(list)
    seen: set[str] = set()  # a feedback_id is an idempotency key: its first row counts, retries do not
    for row in fb.to_pylist():
        key = row.pop("_key")
        row.pop("_ep")
        if row["feedback_id"] in seen:
            continue
        seen.add(row["feedback_id"])
        out[key].append(Feedback(**row))
    return out


class _Writer:
    """One Parquet file, opened on the first non-empty table (an empty split writes an empty file)."""

    def __init__(self, path: Path):
        self.path, self.rows, self._w = path, 0, None

    def write(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        if self._w is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # token lists don't dictionary-encode usefully; trying costs a third of the write
            self._w = pq.ParquetWriter(self.path, DATASET_SCHEMA, use_dictionary=["group_id"])
        self._w.write_table(table)
        self.rows += table.num_rows

    def close(self) -> int:
        if self._w is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(DATASET_SCHEMA.empty_table(), self.path)
        else:
            self._w.close()
        with open(self.path, "rb") as f:
            os.fsync(f.fileno())
        return self.rows

