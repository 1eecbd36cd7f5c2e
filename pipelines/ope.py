"""Off-policy evaluation: a candidate's reward estimated on logged traffic, before it serves any.

    est = ope(log_ratios, rewards, clip=10.0, alpha=0.1)
    est.value     # the candidate's estimated mean reward on the logged prompts
    est.delta     # value - the logged mean reward (what the serving version earned on them)
    est.lower     # the one-sided (1 - alpha) bootstrap lower bound of delta
    est.ess       # the effective sample size of the weights

Each logged episode i was sampled by the serving (behaviour) policy b and earned reward r_i. Its
importance weight for a candidate c is w_i = prod_t c(y_t | ...) / b(y_t | ...) over the tokens
the policy sampled (`log_ratios` holds sum_t log c - log b, with b the logged *processed*
logprobs: the distribution each token was drawn from, temperature applied), clipped at `clip`.
The estimate is self-normalized: V = sum w_i r_i / sum w_i (biased by O(1/n), far lower variance
than the plain mean of w_i r_i, and 0 <= V <= 1 for rewards in [0, 1]). The interval resamples
episodes (a percentile bootstrap of V - mean r on the same resample, so the prompts' difficulty
cancels as in the paired test). A small ESS says the candidate left the logged traffic's support:
the interval is then wide and the gate rightly refuses to call it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class OPEEstimate:
    n: int  # logged episodes
    value: float  # the candidate's self-normalized IS estimate of the mean reward
    logged: float  # the behaviour policy's mean logged reward on the same episodes
    delta: float  # value - logged
    lower: float  # one-sided (1 - alpha) bootstrap lower bound of delta
    upper: float  # one-sided (1 - alpha) bootstrap upper bound of delta
    ess: float  # effective sample size (sum w)^2 / sum w^2
    clipped: int  # weights cut at `clip`
    clip: float
    alpha: float
    max_weight: float

    def to_dict(self) -> dict:
        return asdict(self)


def snis(w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Self-normalized estimates over the last dimension (batched over the rest)."""
    return (w * r).sum(-1) / w.sum(-1).clamp_min(1e-300)


def ope(log_ratios, rewards, clip: float = 10.0, alpha: float = 0.1, resamples: int = 2000,
        seed: int = 0) -> OPEEstimate:
    """The candidate's value on logged episodes (`log_ratios[i]` = its log-likelihood minus the
    behaviour's over episode i's sampled tokens, `rewards[i]` the logged reward)."""
    lr = torch.as_tensor(log_ratios, dtype=torch.float64)
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if lr.ndim != 1 or lr.shape != r.shape or len(r) < 2:
        raise ValueError(f"one log-ratio and one reward per episode, at least 2: got {tuple(lr.shape)}, {tuple(r.shape)}")
    if not bool(torch.isfinite(lr).all() and torch.isfinite(r).all()):
        raise ValueError("log-ratios and rewards must be finite (a NaN logged logprob cannot be weighted)")
    if not clip > 0 or not 0 < alpha < 1:
        raise ValueError(f"clip must be > 0 and alpha in (0, 1), got {clip}, {alpha}")
    w = lr.clamp(max=math.log(clip)).exp()
    value = float(snis(w, r))
    logged = float(r.mean())
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(r), (resamples, len(r)), generator=g)
    deltas = snis(w[idx], r[idx]) - r[idx].mean(-1)
    lower, upper = torch.quantile(deltas, torch.tensor([alpha, 1 - alpha], dtype=torch.float64)).tolist()
    return OPEEstimate(n=len(r), value=value, logged=logged, delta=value - logged, lower=lower, upper=upper,
                       ess=float(w.sum() ** 2 / (w ** 2).sum()), clipped=int((lr > math.log(clip)).sum()),
                       clip=clip, alpha=alpha, max_weight=float(w.max()))


def episode_log_ratios(candidate: torch.Tensor, behaviour: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Per episode, sum over its sampled tokens of candidate - behaviour log-probs (both flat,
    [num_scored] in episode order; `counts` the sampled tokens of each episode)."""
    return torch.stack([c.sum() for c in torch.split((candidate - behaviour).double(), counts)])
