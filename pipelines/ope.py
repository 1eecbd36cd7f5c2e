"""Off-policy evaluation: a candidate's reward estimated on logged traffic, before it serves any.

    est = ope(log_ratios, rewards, clip=10.0, alpha=0.1)          # plain (clipped) importance sampling
    est = ope(log_ratios, rewards, normalize=True)                 # self-normalized
    est = ope(log_ratios, rewards, reference=serving_log_ratios)   # episodes other versions served too
    est.value     # the candidate's estimated mean reward on the logged prompts
    est.delta     # value - the logged mean reward (what the serving version earned on them), or
                  # with `reference`: value - the serving version's own estimate on the same episodes
    est.lower     # the one-sided (1 - alpha) bootstrap lower bound of delta
    est.ess       # the effective sample size of the weights

Each logged episode i was sampled by the serving (behaviour) policy b and earned reward r_i. Its
importance weight for a candidate c is w_i = prod_t c(y_t | ...) / b(y_t | ...) over the tokens
the policy sampled (`log_ratios` holds sum_t log c - log b, with b the logged *processed*
logprobs: the distribution each token was drawn from, temperature applied), clipped at `clip`.
The plain estimate V = mean(w_i r_i) is unbiased but for the clip, and counts the probability
mass the candidate moved off the logged episodes as reward 0; the self-normalized one,
V = sum w_i r_i / sum w_i, has lower variance but spreads that mass over the logged episodes as
if it earned their rewards. An RL candidate moves mass off: on the loop's candidates mean w was
0.82-1.01, and self-normalizing overstated the delta (`bench/ope_check.py`, 7 candidates of one
run: MAE vs the paired eval delta 5.8 points self-normalized, 3.7 plain). Plain is the default.
The interval resamples episodes (a percentile bootstrap of V - mean r on the same resample, so the
prompts' difficulty cancels as in the paired test), or whole clusters of them where `clusters`
names one per episode: the held-out GRPO groups, 8 draws of one prompt whose outcomes move
together, are resampled as groups (a cluster bootstrap), else the interval would claim the
precision of 8x as many prompts. A small ESS says the candidate left the logged traffic's support:
the interval is then wide and the gate rightly refuses to call it.

A cycle's held-out split is a few prompts (5-13 GRPO groups at the default), too few once the
candidate moves far. Earlier cycles' held-out episodes were never trained on either, but other
versions served them: with `reference` (the serving version's log-ratio to each episode's logged
behaviour) the serving version's value is estimated on the same episodes the same way, and the
delta is the difference of the two estimates on each resample (paired: the prompts' difficulty and
much of the weights' noise cancel). On an episode the serving version served itself its weight is 1.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class OPEEstimate:
    n: int  # logged episodes
    value: float  # the candidate's importance-sampling estimate of the mean reward
    logged: float  # the behaviour policy's mean logged reward on the same episodes
    delta: float  # value - logged
    lower: float  # one-sided (1 - alpha) bootstrap lower bound of delta
    upper: float  # one-sided (1 - alpha) bootstrap upper bound of delta
    ess: float  # effective sample size (sum w)^2 / sum w^2
    clipped: int  # weights cut at `clip`
    clip: float
    alpha: float
    max_weight: float
    mean_weight: float  # < 1: the candidate moved probability mass off the logged episodes
    normalized: bool
    clusters: int = 0  # the units the interval resampled when they were groups of episodes (0: episodes)
    referenced: bool = False  # `logged` is the serving version's weighted estimate (episodes others served)

    def to_dict(self) -> dict:
        return asdict(self)


def estimate(w: torch.Tensor, r: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Importance-sampling estimates over the last dimension (batched over the rest)."""
    if normalize:
        return (w * r).sum(-1) / w.sum(-1).clamp_min(1e-300)
    return (w * r).mean(-1)


def ope(log_ratios, rewards, clip: float = 10.0, alpha: float = 0.1, resamples: int = 2000,
        seed: int = 0, normalize: bool = False, clusters=None, reference=None) -> OPEEstimate:
    """The candidate's value on logged episodes (`log_ratios[i]` = its log-likelihood minus the
    behaviour's over episode i's sampled tokens, `rewards[i]` the logged reward; `clusters[i]`, if
    given, the unit the bootstrap resamples episode i with: its group; `reference[i]`, if given,
    the serving version's log-ratio to the same behaviour: the delta is then to its estimate)."""
    lr = torch.as_tensor(log_ratios, dtype=torch.float64)
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if lr.ndim != 1 or lr.shape != r.shape or len(r) < 2:
        raise ValueError(f"one log-ratio and one reward per episode, at least 2: got {tuple(lr.shape)}, {tuple(r.shape)}")
    ref = torch.zeros_like(lr) if reference is None else torch.as_tensor(reference, dtype=torch.float64)
    if ref.shape != lr.shape:
        raise ValueError(f"one reference log-ratio per episode: got {tuple(ref.shape)} for {len(r)} episodes")
    if not bool(torch.isfinite(lr).all() and torch.isfinite(r).all() and torch.isfinite(ref).all()):
        raise ValueError("log-ratios and rewards must be finite (a NaN logged logprob cannot be weighted)")
    if not clip > 0 or not 0 < alpha < 1:
        raise ValueError(f"clip must be > 0 and alpha in (0, 1), got {clip}, {alpha}")
    w, w0 = lr.clamp(max=math.log(clip)).exp(), ref.clamp(max=math.log(clip)).exp()
    value = float(estimate(w, r, normalize))
    logged = float(estimate(w0, r, normalize))  # the logged mean reward where the reference weighs 1
    deltas = _bootstrap(w, w0, r, clusters, resamples, seed, normalize)
    lower, upper = torch.quantile(deltas, torch.tensor([alpha, 1 - alpha], dtype=torch.float64)).tolist()
    return OPEEstimate(n=len(r), value=value, logged=logged, delta=value - logged, lower=lower, upper=upper,
                       ess=float(w.sum() ** 2 / (w ** 2).sum()), clipped=int((lr > math.log(clip)).sum()),
                       clip=clip, alpha=alpha, max_weight=float(w.max()), mean_weight=float(w.mean()),
                       normalized=normalize, clusters=len(set(clusters)) if clusters is not None else 0,
                       referenced=reference is not None)


def _bootstrap(w: torch.Tensor, w0: torch.Tensor, r: torch.Tensor, clusters, resamples: int, seed: int,
               normalize: bool) -> torch.Tensor:
    """`resamples` bootstrap draws of V(w) - V(w0) on the same resample: of episodes, or of whole
    clusters (per-cluster sums of w r, w and counts, so a draw of clusters draws all their episodes)."""
    g = torch.Generator().manual_seed(seed)
    if clusters is None:
        idx = torch.randint(len(r), (resamples, len(r)), generator=g)
        return estimate(w[idx], r[idx], normalize) - estimate(w0[idx], r[idx], normalize)
    if len(clusters) != len(r):
        raise ValueError(f"one cluster per episode: got {len(clusters)} for {len(r)} episodes")
    names: dict = {}
    of = torch.tensor([names.setdefault(c, len(names)) for c in clusters])
    sums = lambda x: torch.zeros(len(names), dtype=torch.float64).index_add_(0, of, x)  # noqa: E731
    ns = sums(torch.ones_like(r))
    idx = torch.randint(len(names), (resamples, len(names)), generator=g)
    n = ns[idx].sum(-1)

    def value(weights):
        wr, ws = sums(weights * r), sums(weights)
        return wr[idx].sum(-1) / (ws[idx].sum(-1).clamp_min(1e-300) if normalize else n)
    return value(w) - value(w0)


def episode_log_ratios(candidate: torch.Tensor, behaviour: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Per episode, sum over its sampled tokens of candidate - behaviour log-probs (both flat,
    [num_scored] in episode order; `counts` the sampled tokens of each episode)."""
    return torch.stack([c.sum() for c in torch.split((candidate - behaviour).double(), counts)])


def per_episode(log_ratios: torch.Tensor, rewards, episode_ids) -> tuple[torch.Tensor, list[float]]:
    """Rows of one episode (segments of a re-tokenized one) as one: their log-ratios summed (the
    episode's probability ratio is the product over all its sampled tokens), its reward once."""
    order: dict[str, int] = {}
    for e in episode_ids:
        order.setdefault(e, len(order))
    index = torch.tensor([order[e] for e in episode_ids])
    summed = torch.zeros(len(order), dtype=log_ratios.dtype).index_add_(0, index, log_ratios)
    first = {}
    for e, r in zip(episode_ids, rewards):
        first.setdefault(e, float(r))
    return summed, [first[e] for e in order]
