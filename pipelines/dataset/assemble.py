"""Traces -> episodes, vectorized: row filters, episode order, alignment checks, token arrays.

Invariants of what comes out (and so of the dataset):
- an episode is the trace rows sharing `episode_id` (a row without one is a one-turn episode
  keyed by its trace id), ordered by `turn`, with turns exactly 0..n-1;
- turn k+1's `prompt_token_ids` starts with turn k's prompt + completion ids, so the last turn's
  prompt + completion (`input_ids`) holds every turn's completion at the offset where it was
  sampled: turn k's completion sits at [len(prompt_k), len(prompt_k) + len(completion_k));
- `assistant_mask` is 1 exactly there; `behaviour_logprobs` and `weight_versions` carry that
  turn's logged logprobs and serving version there, and 0 / -1 elsewhere (prompt, tool output).

Row-level drops (a row is removed, its episode may survive): "status_not_ok" (error/aborted
requests), "duplicate_trace" (a trace id seen before: a replayed row), "duplicate_turn" (an
earlier attempt of an (episode, turn) that a retry superseded: the latest `created_at` wins).
Episode-level drops: "missing_turn" (turn numbers are not 0..n-1), "logprobs_mode" (a turn's
logprobs were not in the trainer's mode), "logprobs_length" (a turn logs a logprob count other
than its completion length), "misaligned" (a prompt does not extend the previous turn).

Everything here is numpy over flat token arrays; no Python loop runs per token or per row.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# trace columns the dataset build reads
READ_COLUMNS = ["trace_id", "episode_id", "turn", "created_at", "weight_version", "status", "sampling",
                "prompt_token_ids", "completion_token_ids", "completion_logprobs"]


@dataclass
class EpisodeOrder:
    """The surviving rows of a trace table, sorted by (episode, turn), with episode verdicts.

    Shapes: R surviving rows, E episodes. `rows` (R,) indexes the trace table; episode e owns
    sorted positions [starts[e], starts[e+1]).
    """

    rows: np.ndarray  # (R,) int64, table row of each sorted position
    starts: np.ndarray  # (E+1,) int64
    bad: np.ndarray  # (E,) object: None when the episode passes the row-metadata checks, else a reason
    dropped_rows: Counter


def order_episodes(meta: pa.Table, logprobs_mode: str) -> EpisodeOrder:
    """Row filters and episode order from the metadata columns of `READ_COLUMNS` (no tokens)."""
    dropped = Counter()
    n = meta.num_rows
    keep = np.asarray(pc.equal(meta["status"], "ok").fill_null(False), dtype=bool)
    dropped["status_not_ok"] = int(n - keep.sum())

    trace_codes = _codes(meta["trace_id"])
    first = np.zeros(n, dtype=bool)
    _, first_idx = np.unique(trace_codes, return_index=True)
    first[first_idx] = True  # the first copy of each trace id
    dropped["duplicate_trace"] = int((keep & ~first).sum())
    keep &= first

    ep_codes = _codes(pc.coalesce(meta["episode_id"], meta["trace_id"]))
    turn = np.asarray(meta["turn"].fill_null(0), dtype=np.int64)
    created = np.asarray(pc.cast(meta["created_at"], pa.int64()).fill_null(0), dtype=np.int64)
    rows = np.flatnonzero(keep)
    # sort by episode, turn, newest first; the first row of each (episode, turn) wins
    rows = rows[np.lexsort((-created[rows], turn[rows], ep_codes[rows]))]
    e, t = ep_codes[rows], turn[rows]
    dup = np.zeros(len(rows), dtype=bool)
    dup[1:] = (e[1:] == e[:-1]) & (t[1:] == t[:-1])
    dropped["duplicate_turn"] = int(dup.sum())
    rows, e, t = rows[~dup], e[~dup], t[~dup]

    new_ep = np.ones(len(rows), dtype=bool)
    new_ep[1:] = e[1:] != e[:-1]
    starts = np.append(np.flatnonzero(new_ep), len(rows)).astype(np.int64)
    ep_of_row = np.cumsum(new_ep) - 1
    position = np.arange(len(rows)) - starts[ep_of_row]
    n_ep = len(starts) - 1
    bad = np.full(n_ep, None, dtype=object)

    modes = pc.struct_field(meta["sampling"], "logprobs_mode").to_numpy(zero_copy_only=False)[rows]
    _mark(bad, ep_of_row[modes != logprobs_mode], "logprobs_mode")
    _mark(bad, ep_of_row[t != position], "missing_turn")
    return EpisodeOrder(rows=rows, starts=starts, bad=bad, dropped_rows=dropped)


@dataclass
class EpisodeTokens:
    """Token arrays of K kept episodes (of one chunk), flat with offsets.

    `offsets` (K+1,) int64 delimits episode k's tokens in every flat array, all of length N:
    `input_ids` int32, `assistant_mask` int8, `behaviour_logprobs` float32, `weight_versions`
    int64. `first_prompt_len` (K,) is turn 0's prompt length.
    """

    episodes: np.ndarray  # (K,) int64: index into the chunk's episodes
    offsets: np.ndarray
    input_ids: np.ndarray
    assistant_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    weight_versions: np.ndarray
    first_prompt_len: np.ndarray


def _flat(col: pa.ChunkedArray | pa.Array, dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values, offsets (n+1,), lengths (n,)) of a list column; nulls count as empty lists."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    lengths = np.asarray(pc.list_value_length(col).fill_null(0), dtype=np.int64)
    values = np.asarray(pc.list_flatten(col), dtype=dtype)
    return values, np.concatenate([[0], np.cumsum(lengths)]), lengths


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated aranges: (owner (T,), starts[owner] + i for i < lengths[owner])."""
    owner = np.repeat(np.arange(len(lengths)), lengths)
    base = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else np.zeros(0, np.int64)
    within = np.arange(len(owner)) - base[owner]
    return owner, starts[owner] + within


def assemble(chunk: pa.Table, starts: np.ndarray, bad: np.ndarray) -> tuple[EpisodeTokens, np.ndarray]:
    """Check alignment and build token arrays for the episodes of `chunk`.

    `chunk` holds the rows of some episodes in sorted order (episode e: rows [starts[e],
    starts[e+1])); `bad` (E,) their verdicts so far, updated in place with "logprobs_length"
    and "misaligned". Returns the kept episodes' tokens and the updated `bad`.
    """
    P, P_off, P_len = _flat(chunk["prompt_token_ids"], np.int32)
    C, C_off, C_len = _flat(chunk["completion_token_ids"], np.int32)
    L, L_off, L_len = _flat(chunk["completion_logprobs"], np.float32)
    n_ep = len(starts) - 1
    lengths = np.diff(starts)
    ep_of_row = np.repeat(np.arange(n_ep), lengths)
    _mark(bad, ep_of_row[L_len != C_len], "logprobs_length")

    # pairs (i, i+1) of consecutive turns: prompt_{i+1}[:need] == prompt_i + completion_i
    i = np.flatnonzero(ep_of_row[1:] == ep_of_row[:-1])
    j = i + 1
    need = P_len[i] + C_len[i]
    short = P_len[j] < need
    _mark(bad, ep_of_row[i[short]], "misaligned")
    i, j, need = i[~short], j[~short], need[~short]
    pair, pos = _ranges(np.zeros(len(i), np.int64), need)
    observed = P[P_off[j][pair] + pos]
    in_prompt = pos < P_len[i][pair]
    expected = np.where(in_prompt, P[np.minimum(P_off[i][pair] + pos, max(len(P) - 1, 0))],
                        C[np.clip(C_off[i][pair] + pos - P_len[i][pair], 0, max(len(C) - 1, 0))])
    wrong = np.zeros(len(i), dtype=bool)
    wrong[pair[observed != expected]] = True
    _mark(bad, ep_of_row[i[wrong]], "misaligned")

    kept = np.array([b is None for b in bad], dtype=bool) if n_ep else np.zeros(0, bool)
    eps = np.flatnonzero(kept)
    last = starts[eps + 1] - 1
    first = starts[eps]
    out_len = P_len[last] + C_len[last]
    offsets = np.concatenate([[0], np.cumsum(out_len)]).astype(np.int64)
    total = int(offsets[-1])

    # input_ids = last prompt ++ last completion
    owner, src = _ranges(P_off[last], P_len[last])
    dst = offsets[:-1][owner] + (src - P_off[last][owner])
    input_ids = np.empty(total, dtype=np.int32)
    input_ids[dst] = P[src]
    owner, src = _ranges(C_off[last], C_len[last])
    input_ids[offsets[:-1][owner] + P_len[last][owner] + (src - C_off[last][owner])] = C[src]

    # every turn of a kept episode: its completion's slot in input_ids
    k_of_ep = np.full(n_ep, -1, dtype=np.int64)
    k_of_ep[eps] = np.arange(len(eps))
    turn_rows = np.flatnonzero(kept[ep_of_row]) if n_ep else np.zeros(0, np.int64)
    owner, src = _ranges(C_off[turn_rows], C_len[turn_rows])
    row = turn_rows[owner]
    dst = offsets[:-1][k_of_ep[ep_of_row[row]]] + P_len[row] + (src - C_off[row])
    mask = np.zeros(total, dtype=np.int8)
    mask[dst] = 1
    logprobs = np.zeros(total, dtype=np.float32)
    logprobs[dst] = L[L_off[row] + (src - C_off[row])]
    versions = np.full(total, -1, dtype=np.int64)
    versions[dst] = np.asarray(chunk["weight_version"], dtype=np.int64)[row]
    tokens = EpisodeTokens(episodes=eps, offsets=offsets, input_ids=input_ids, assistant_mask=mask,
                           behaviour_logprobs=logprobs, weight_versions=versions,
                           first_prompt_len=P_len[first].astype(np.int32))
    return tokens, bad


def first_prompts(chunk: pa.Table, starts: np.ndarray, eps: np.ndarray) -> list[bytes]:
    """Turn 0's prompt token ids of each episode in `eps`, as int32 bytes (for group ids)."""
    P, P_off, P_len = _flat(chunk["prompt_token_ids"], np.int32)
    first = starts[eps]
    return [P[P_off[r]:P_off[r] + P_len[r]].tobytes() for r in first]


def drop_counts(bad: np.ndarray) -> Counter:
    return Counter(b for b in bad if b is not None)


def _mark(bad: np.ndarray, eps: np.ndarray, reason: str) -> None:
    """Give `reason` to the episodes in `eps` that have no reason yet (the first check wins)."""
    if len(eps) == 0:
        return
    eps = np.unique(eps)
    fresh = eps[np.array([bad[e] is None for e in eps], dtype=bool)]
    bad[fresh] = reason


def _codes(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Dense integer codes of a string column (equal strings, equal codes)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    return np.asarray(pc.dictionary_encode(col).indices, dtype=np.int64)
