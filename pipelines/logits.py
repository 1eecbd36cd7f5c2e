"""Teacher-forced next-token distributions over a dataset's token sequences, and the per-token KL
statistics that requantize's plan search and the validate gate share.

A dataset episode is `input_ids` with an `assistant_mask` marking the tokens the policy sampled.
The distributions that matter are the ones those tokens were sampled from: position t is *scored*
when token t+1 was sampled. Every model is run over the same padded batch and its log-softmax is
kept at the scored positions only, in one fixed order, so two models' rows line up token for token.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Sequences:
    ids: tuple[tuple[int, ...], ...]
    sampled: tuple[tuple[int, ...], ...]  # per sequence: 1 where the token was sampled by the policy
    source: str  # "<dataset folder>:<split>"
    episode_ids: tuple[str, ...] = ()  # per sequence, when drawn from a dataset
    # per sequence, per token: the temperature it was sampled at (a dataset's `temperatures`); ():
    # all 1. The KL statistics compare the distributions tokens were drawn from: softmax(logits / T)
    temperatures: tuple[tuple[float, ...], ...] = ()
    # per sequence, from a dataset: the logged behaviour logprob of each token (the served policy's,
    # the distribution it was drawn from) and the episode's reward: what off-policy evaluation weighs
    behaviour: tuple[tuple[float, ...], ...] = ()
    rewards: tuple[float, ...] = ()
    group_ids: tuple[str, ...] = ()  # per sequence, from a dataset: its GRPO group (OPE resamples groups)

    @property
    def num_scored(self) -> int:
        return sum(sum(m[1:]) for m in self.sampled)

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.ids)

    def head(self, n: int) -> "Sequences":
        return self.rows(0, n)

    def rows(self, start: int, stop: int | None = None) -> "Sequences":
        return Sequences(self.ids[start:stop], self.sampled[start:stop], self.source, self.episode_ids[start:stop],
                         self.temperatures[start:stop], self.behaviour[start:stop], self.rewards[start:stop],
                         self.group_ids[start:stop])


def dataset_sequences(dataset: str | Path, split: str, max_sequences: int, seed: int = 0) -> Sequences:
    """Up to `max_sequences` episodes of a dataset split, drawn by a hash of their episode ids (the
    same draw on every machine), each checked against the files the manifest lists."""
    import pyarrow.parquet as pq

    from rollout.artifacts import file_sha256
    from pipelines.dataset.manifest import load_manifest

    folder = Path(dataset)
    manifest = load_manifest(folder)
    files = sorted(p for p in manifest.files if p.startswith(split + "/"))
    for rel in files:
        if file_sha256(folder / rel) != manifest.files[rel]:
            raise ValueError(f"{folder / rel} does not match its dataset manifest sha256")
    rows = [r for rel in files for r in pq.read_table(folder / rel, columns=[
        "episode_id", "group_id", "input_ids", "assistant_mask", "temperatures", "behaviour_logprobs", "reward"]).to_pylist()]
    rows = [r for r in rows if any(r["assistant_mask"][1:])]
    if not rows:
        raise ValueError(f"{folder}: split {split!r} holds no episodes with sampled tokens")
    rows.sort(key=lambda r: hashlib.sha256(f"{seed}:{r['episode_id']}".encode()).hexdigest())
    rows = rows[:max_sequences]
    return Sequences(tuple(tuple(r["input_ids"]) for r in rows), tuple(tuple(r["assistant_mask"]) for r in rows),
                     f"{folder}:{split}", tuple(r["episode_id"] for r in rows),
                     tuple(tuple(r["temperatures"]) for r in rows), tuple(tuple(r["behaviour_logprobs"]) for r in rows),
                     tuple(float(r["reward"]) for r in rows), tuple(r["group_id"] for r in rows))


def heldout_history(first: Sequences, dataset: str | Path, datasets_dir: Path, max_sequences: int,
                    max_datasets: int) -> list[Sequences]:
    """`first` (the held-out episodes of `dataset`), then those of the earlier datasets beside it in
    `datasets_dir` (named by creation time), newest first: never trained on by a later candidate,
    served by earlier versions. At most `max_datasets` sets and `max_sequences` episodes; a folder
    that holds no finished dataset or no held-out split is passed over."""
    out, left = [first], max_sequences - len(first.ids)
    own = Path(dataset).resolve()
    for d in sorted(Path(datasets_dir).glob("*/"), key=lambda d: d.name, reverse=True):
        if len(out) >= max_datasets or left <= 0:
            break
        if d.resolve() == own or d.name > own.name:
            continue  # the candidate's own, or a later one
        try:
            s = dataset_sequences(d, "heldout", left)
        except (ValueError, OSError):
            continue
        out.append(s)
        left -= len(s.ids)
    return out


def batches(seqs: Sequences, batch_size: int):
    """(input_ids [B, T], attention_mask [B, T], scored [B, T-1] bool) per batch, right-padded."""
    for i in range(0, len(seqs.ids), batch_size):
        ids, sampled = seqs.ids[i:i + batch_size], seqs.sampled[i:i + batch_size]
        n = max(len(s) for s in ids)
        x = torch.zeros((len(ids), n), dtype=torch.long)
        attn = torch.zeros((len(ids), n), dtype=torch.long)
        scored = torch.zeros((len(ids), n - 1), dtype=torch.bool)
        for j, (s, m) in enumerate(zip(ids, sampled)):
            x[j, :len(s)] = torch.tensor(s)
            attn[j, :len(s)] = 1
            scored[j, :len(s) - 1] = torch.tensor(m[1:], dtype=torch.bool)
        yield x, attn, scored


@torch.no_grad()
def model_logprobs(model, seqs: Sequences, batch_size: int = 16) -> torch.Tensor:
    """[num_scored, vocab] float32 log-probabilities of `model` (a transformers causal LM) at the
    scored positions, in sequence order."""
    out = []
    for x, attn, scored in batches(seqs, batch_size):
        logits = model(input_ids=x, attention_mask=attn).logits[:, :-1]
        out.append(torch.log_softmax(logits[scored].float(), dim=-1))
    return torch.cat(out)


def scored_targets(seqs: Sequences) -> torch.Tensor:
    """[num_scored] the sampled token at each scored position."""
    return torch.tensor([s[t + 1] for s, m in zip(seqs.ids, seqs.sampled) for t in range(len(s) - 1) if m[t + 1]])


def scored_behaviour(seqs: Sequences) -> torch.Tensor:
    """[num_scored] the logged behaviour logprob of each scored position's next token."""
    if not seqs.behaviour:
        raise ValueError(f"{seqs.source}: these sequences carry no logged behaviour logprobs")
    return torch.tensor([b[i + 1] for b, m in zip(seqs.behaviour, seqs.sampled) for i in range(len(m) - 1)
                         if m[i + 1]], dtype=torch.float32)


def scored_counts(seqs: Sequences) -> list[int]:
    """The scored positions of each sequence (its sampled tokens but a first one)."""
    return [sum(m[1:]) for m in seqs.sampled]


def scored_temperatures(seqs: Sequences) -> torch.Tensor:
    """[num_scored] the temperature each scored position's next token was sampled at (1 when unknown)."""
    if not seqs.temperatures:
        return torch.ones(seqs.num_scored)
    return torch.tensor([t[i + 1] for t, m in zip(seqs.temperatures, seqs.sampled) for i in range(len(m) - 1)
                         if m[i + 1]], dtype=torch.float32)


def at_temperature(logprobs: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Rows [N, V] of log-probabilities at T=1 -> at each row's temperature: log_softmax(lp / T). A
    row with unknown (NaN) entries (an engine's top-k) stays at T=1: its tail cannot be rescaled."""
    if bool((temperatures == 1).all()):
        return logprobs
    scaled = torch.log_softmax(logprobs / temperatures[:, None].to(logprobs.dtype), dim=-1)
    partial = torch.isnan(logprobs).any(-1, keepdim=True)
    return torch.where(partial, logprobs, scaled)


def kl(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(P || Q) in nats from full log-probability rows [N, V]; a NaN in either row
    makes that token's KL NaN (never 0)."""
    terms = p_logprobs.exp() * (p_logprobs - q_logprobs)
    terms = torch.where(p_logprobs == -torch.inf, torch.zeros_like(terms), terms)
    return terms.sum(-1).clamp_min(0.0)


def summary(x: torch.Tensor) -> dict[str, float]:
    """mean, p50, p90, p99 and max of a per-token statistic (NaN anywhere: all NaN)."""
    x = x.double()
    if x.numel() == 0 or not torch.isfinite(x).all():
        return {k: float("nan") for k in ("mean", "p50", "p90", "p99", "max")}
    q = torch.quantile(x, torch.tensor(QUANTILES, dtype=x.dtype))
    return {"mean": x.mean().item(), "p50": q[0].item(), "p90": q[1].item(), "p99": q[2].item(),
            "max": x.max().item()}


def flip_rate(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> float:
    """Fraction of scored positions whose most likely token differs."""
    return (p_logprobs.argmax(-1) != q_logprobs.argmax(-1)).double().mean().item()


def kl_known(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(P || Q) where P's rows are known only where not NaN (an engine's top-k): the
    known entries plus one bucket for the rest of the mass on each side. With every entry known it
    is the exact KL; otherwise the KL of the coarsened distributions, a lower bound of the exact one."""
    known = ~torch.isnan(p_logprobs)
    p = torch.where(known, p_logprobs.exp(), torch.zeros_like(p_logprobs))
    q = torch.where(known, q_logprobs.exp(), torch.zeros_like(q_logprobs))
    terms = torch.where(known & (p_logprobs != -torch.inf), p * (p_logprobs - q_logprobs), torch.zeros_like(p))
    p_rest, q_rest = (1 - p.sum(-1)).clamp_min(0), (1 - q.sum(-1)).clamp_min(1e-30)
    rest = torch.where(p_rest > 1e-6, p_rest * (p_rest.clamp_min(1e-30).log() - q_rest.log()), torch.zeros_like(p_rest))
    return (terms.sum(-1) + rest).clamp_min(0.0)
