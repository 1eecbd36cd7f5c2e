"""Dataset-building throughput (trace rows/s) on a generated trace table of a million rows.

The table holds 2-turn calculator episodes with real token ids (the tiny tokenizer's rendering of
task demonstrations: turn 1's prompt extends turn 0's prompt + completion exactly), random
behaviour logprobs, spread over 2 dates x 4 weight versions, and feedback for 10% of episodes.
It is written straight to the partition layout the server's writer produces. Then
`build_dataset` runs on the whole window and on a pruned one (1 date, 2 versions), with the
default task reward (decodes every episode) and with a feedback-only reward, so the split of the
time between the vectorized assembly and the per-episode reward function shows.

    python bench/dataset_build.py [--rows 1000000] [--tokenizer .cache/flywheel-test/base-*]
"""

from __future__ import annotations

import argparse
import glob
import shutil
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.traces_to_dataset import DatasetConfig, build_dataset
from rollout.chat import ChatFormat
from rollout.episode import after_turn
from rollout.tasks.calculator import TASK, calculator, demonstration, make_problems
from rollout.traces.schema import FEEDBACK_SCHEMA, SAMPLING_TYPE, STACK_TYPE, TRACE_SCHEMA

DATES = ("2026-12-01", "2026-12-02")
VERSIONS = (1, 2, 3, 4)


def _episode_tokens(tok, n_problems: int):
    """Per problem: (turn 0 prompt, turn 0 completion, turn 1 prompt, turn 1 completion) ids."""
    out = []
    for p in make_problems("train", n_problems, seed=11):
        demo = demonstration(p)
        p0 = ChatFormat.of(tok, TASK.tools).prompt(p.messages())
        call = demo[2]["tool_calls"][0]["function"]
        c0 = tok.encode(f'<tool_call>\n{{"name": "calculator", "arguments": {call["arguments"]}}}\n</tool_call>'
                        "<|im_end|>", add_special_tokens=False)
        p1 = p0 + c0 + after_turn(ChatFormat.of(tok, TASK.tools), demo[:3], [demo[3]])[1]
        c1 = tok.encode(f"Answer: {p.answer}<|im_end|>", add_special_tokens=False)
        out.append((p0, c0, p1, c1))
    return out


def _lists(seqs: list[list[int]], idx: np.ndarray) -> pa.Array:
    return pa.array(seqs, pa.list_(pa.int32())).take(pa.array(idx))


def write_table(root: Path, rows: int, tok, n_problems: int = 512, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    eps = rows // 2
    per = _episode_tokens(tok, n_problems)
    prob = rng.integers(0, n_problems, eps)
    ep_ids = np.char.add("ep-", np.arange(eps).astype(str))
    t0 = datetime(2026, 12, 1, tzinfo=timezone.utc)
    part_of_ep = rng.integers(0, len(DATES) * len(VERSIONS), eps)
    for turn in (0, 1):
        P = _lists([x[2 * turn] for x in per], prob)
        C = _lists([x[2 * turn + 1] for x in per], prob)
        n_c = np.asarray(pa.compute.list_value_length(C))
        lps = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(n_c)]).astype(np.int32)),
                                       pa.array(-rng.exponential(0.3, int(n_c.sum())).astype(np.float32)))
        for part in range(len(DATES) * len(VERSIONS)):
            sel = np.flatnonzero(part_of_ep == part)
            d, v = DATES[part // len(VERSIONS)], VERSIONS[part % len(VERSIONS)]
            n = len(sel)
            created = pa.array([t0 + timedelta(days=part // len(VERSIONS), seconds=turn)] * n,
                               pa.timestamp("us", tz="UTC"))
            ids = pa.array(np.char.add(ep_ids[sel], f"-{turn}"))
            cols = {
                "trace_id": ids, "request_id": ids, "episode_id": pa.array(ep_ids[sel]),
                "turn": pa.array(np.full(n, turn, np.int32)), "created_at": created, "date": pa.repeat(d, n),
                "model": pa.repeat("flywheel", n), "weight_version": pa.array(np.full(n, v, np.int64)),
                "checkpoint_sha256": pa.repeat("0" * 64, n), "speculator_version": pa.nulls(n, pa.string()),
                "stack": pa.repeat(pa.scalar({"engine": "vllm", "engine_version": "0.32", "quant_format": "none",
                                              "kv_cache_dtype": "auto", "device": "cpu", "device_name": "bench",
                                              "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                                              "torch_version": "2", "flywheel_version": "0", "kernel_build": "_C"}, STACK_TYPE), n),
                "messages": pa.repeat("[]", n), "tools": pa.nulls(n, pa.string()),
                "sampling": pa.repeat(pa.scalar({"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 48,
                                                 "seed": None, "logprobs_mode": "processed_logprobs"}, SAMPLING_TYPE), n),
                "prompt_token_ids": P.take(pa.array(sel)), "completion_token_ids": C.take(pa.array(sel)),
                "completion_logprobs": lps.take(pa.array(sel)),
                "completion_weight_versions": pa.nulls(n, pa.list_(pa.int64())), "output": pa.repeat("{}", n),
                "finish_reason": pa.repeat("stop", n), "status": pa.repeat("ok", n), "error": pa.nulls(n, pa.string()),
                "ttft_ms": pa.repeat(1.0, n), "e2e_ms": pa.repeat(2.0, n),
                "num_cached_prompt_tokens": pa.array(np.zeros(n, np.int32)),
                "spec_draft_tokens": pa.array(np.zeros(n, np.int32)),
                "spec_accepted_tokens": pa.array(np.zeros(n, np.int32)),
                "schema_version": pa.array(np.ones(n, np.int16)),
            }
            out = root / "traces" / f"date={d}" / f"weight_version={v}"
            out.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.table(cols, schema=TRACE_SCHEMA), out / f"part-t{turn}.parquet")
    fb = rng.choice(eps, eps // 10, replace=False)
    n = len(fb)
    fdir = root / "feedback" / f"date={DATES[-1]}"
    fdir.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({
        "feedback_id": pa.array(np.char.add("fb-", fb.astype(str))), "trace_id": pa.array(np.char.add(ep_ids[fb], "-1")),
        "episode_id": pa.array(ep_ids[fb]), "reward": pa.array(rng.random(n)), "rating": pa.nulls(n, pa.int32()),
        "comment": pa.nulls(n, pa.string()), "source": pa.repeat("user", n),
        "created_at": pa.array([t0 + timedelta(days=1)] * n, pa.timestamp("us", tz="UTC")),
        "date": pa.repeat(DATES[-1], n), "schema_version": pa.array(np.ones(n, np.int16)),
    }, schema=FEEDBACK_SCHEMA), fdir / "part-0.parquet")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the test cache's tiny base)")
    args = ap.parse_args()
    tok_path = args.tokenizer or sorted(glob.glob(".cache/flywheel*/base-*"))[0]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_path)
    work = Path(tempfile.mkdtemp(prefix="fw-dsbench-"))
    try:
        t = time.perf_counter()
        write_table(work / "data", args.rows, tok)
        size = sum(p.stat().st_size for p in (work / "data").rglob("*.parquet")) / 2**20
        print(f"[table] {args.rows} trace rows ({args.rows // 2} 2-turn episodes, {len(DATES)} dates x "
              f"{len(VERSIONS)} versions, {size:.0f} MiB Parquet) written in {time.perf_counter() - t:.1f} s")
        cases = [("all, task reward", {}, "pipelines.rewards:task_reward", "override"),
                 ("all, feedback only", {}, "pipelines.rewards:feedback_reward", "override"),
                 ("1 date x 2 versions", dict(dates=(DATES[0],), weight_versions=(1, 2)),
                  "pipelines.rewards:task_reward", "override")]
        for i, (label, window, fn, mode) in enumerate(cases):
            cfg = DatasetConfig(trace_root=work / "data", out_dir=work / f"ds{i}", tokenizer=tok_path,
                                reward_fn=fn, feedback_mode=mode, **window)
            t = time.perf_counter()
            m = build_dataset(cfg)
            dt = time.perf_counter() - t
            print(f"[build] {label:22s} {m.rows_read:8d} rows -> {m.kept_episodes:7d} episodes "
                  f"(dropped {sum(m.dropped_episodes.values())}) in {dt:6.2f} s: {m.rows_read / dt:9.0f} traces/s")
            shutil.rmtree(work / f"ds{i}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
