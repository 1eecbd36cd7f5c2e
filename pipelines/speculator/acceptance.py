"""Expected speculative acceptance of a draft against its target, offline, on held-out requests.

What vLLM does (v1 draft-model speculation, its defaults): from a prefix the draft proposes k
tokens greedily, d_1..d_k; the target scores them in one forward and rejection-samples at the
request's temperature T. A greedy draft is a point mass, so d_j is accepted with probability
a_j = p_T(d_j | prefix, d_<j) (at T = 0: 1 when d_j is the target's argmax, else 0), and the
step stops at the first rejection. Per step:

    E[accepted] = sum_{i=1..k} prod_{j<=i} a_j        (the bonus token is not counted)

This module plays exactly that from every scored start of the held-out requests (prefix = the
served tokens before a sampled one): the draft's own k proposals, the target's probabilities of
them. It is an estimate of the live rate only in where the steps start (live, a step starts
after the previous one's accepted tokens).
"""

from __future__ import annotations

import torch

from pipelines.logits import Sequences
from pipelines.speculator.config import Acceptance


def draft_starts(seqs: Sequences, max_positions: int, seed: int = 0) -> list[tuple[int, int]]:
    """(sequence, t) for up to `max_positions` sampled tokens t (the draft proposes from ids[:t])."""
    starts = [(i, t) for i, m in enumerate(seqs.sampled) for t in range(1, len(m)) if m[t]]
    if len(starts) > max_positions:
        keep = torch.randperm(len(starts), generator=torch.Generator().manual_seed(seed))[:max_positions]
        starts = [starts[j] for j in sorted(keep.tolist())]
    return starts


def left_padded(prefixes: list[tuple[int, ...]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(p) for p in prefixes)
    x = torch.full((len(prefixes), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prefixes), n), dtype=torch.long)
    for j, p in enumerate(prefixes):
        x[j, n - len(p):] = torch.tensor(p)
        mask[j, n - len(p):] = 1
    return x, mask


def _logits(model, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return model(input_ids=x, attention_mask=mask, position_ids=pos, use_cache=False).logits.float()


@torch.no_grad()
def step_acceptance(target, draft, x: torch.Tensor, mask: torch.Tensor, k: int, temperature: float) -> torch.Tensor:
    """[B, k] acceptance probabilities a_j of the draft's greedy proposals from left-padded prefixes."""
    n = x.shape[1]
    for _ in range(k):
        d = _logits(draft, x, mask)[:, -1].argmax(-1, keepdim=True)
        x, mask = torch.cat([x, d], 1), torch.cat([mask, torch.ones_like(d)], 1)
    proposals = x[:, n:]
    logits = _logits(target, x, mask)[:, n - 1:-1]  # the target's distributions over each proposal
    if temperature == 0:
        return (logits.argmax(-1) == proposals).float()
    probs = torch.softmax(logits / temperature, dim=-1)
    return probs.gather(-1, proposals[..., None])[..., 0]


def expected_acceptance(target, draft, seqs: Sequences, k: int, temperature: float, max_positions: int = 2000,
                        batch_size: int = 128, pad_id: int = 0, seed: int = 0) -> Acceptance:
    """E[accepted draft tokens per step] over the held-out starts (see the module docstring)."""
    starts = draft_starts(seqs, max_positions, seed)
    if not starts:
        raise ValueError(f"{seqs.source}: no sampled tokens to start a draft from")
    total = 0.0
    for s in range(0, len(starts), batch_size):
        chunk = starts[s:s + batch_size]
        x, mask = left_padded([seqs.ids[i][:t] for i, t in chunk], pad_id)
        a = step_acceptance(target, draft, x, mask, k, temperature)
        total += float(a.cumprod(-1).sum())
    return Acceptance(k=k, temperature=float(temperature), positions=len(starts), mean_accepted=total / len(starts))
