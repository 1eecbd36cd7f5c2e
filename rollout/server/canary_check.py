"""Is the canary worse than stable on its own live traffic? From the traces and feedback alone.

    c = compare_versions(trace_root, stable=3, canary=4, since=t0, margin=0.05)
    c.passed, c.reward_diff, c.interval, c.logprob_diff

Each episode with a reward in the feedback store (its turns all carry one weight version: the
fleet pins it) counts once, with that reward and the mean behaviour logprob of its sampled tokens
(each version's own policy on its own traffic; requests without feedback are left out, as their
prompts may be of another kind altogether and the two groups' mixes differ by chance). The canary passes when the lower ends of the 95%
intervals of (canary - stable) are above -margin for the mean episode reward and above
-logprob_margin for the mean token logprob: it is promoted on evidence that it is not worse, so
too little traffic fails it (and rolls it back), as does a clearly worse one. The logprob
catches what a sparse reward cannot see: weights that sample near-uniform garbage lose nats per
token long before the task's success rate can show it (a policy trained by RL usually grows more
confident on its own traffic, not less). The default logprob margin, 0.5 nats a token, is wide:
on the tiny model two replicas of one version differed by 0.11 on ~500 episodes of live traffic,
a canary 0.5% off the stable weights by -0.19 to +0.7 (tests/rollout/server/test_fleet.py runs),
while weights that sample uniformly lose ~5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

from rollout.traces import read_feedback, read_traces


@dataclass(frozen=True)
class VersionStats:
    episodes: int  # with a reward
    reward: float  # mean episode reward
    reward_var: float
    logprob_episodes: int  # of those, with sampled tokens
    logprob: float  # mean over episodes of their mean sampled-token logprob
    logprob_var: float


@dataclass(frozen=True)
class CanaryComparison:
    stable: VersionStats
    canary: VersionStats
    reward_diff: float  # canary - stable
    interval: tuple[float, float]  # 95%, normal approximation (Welch)
    logprob_diff: float
    logprob_interval: tuple[float, float]
    margin: float
    logprob_margin: float

    @property
    def passed(self) -> bool:
        return self.interval[0] > -self.margin and self.logprob_interval[0] > -self.logprob_margin

    def summary(self) -> str:
        return (f"canary {self.canary.reward:.3f} ({self.canary.episodes} episodes) vs stable {self.stable.reward:.3f} "
                f"({self.stable.episodes}): {self.reward_diff:+.3f} [{self.interval[0]:+.3f}, {self.interval[1]:+.3f}], "
                f"token logprob {self.logprob_diff:+.3f} [{self.logprob_interval[0]:+.3f}, {self.logprob_interval[1]:+.3f}]: "
                f"{'pass' if self.passed else 'fail'} (margins {self.margin}, {self.logprob_margin})")


def _mean_var(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    mean = sum(xs) / n if n else float("nan")
    return mean, (sum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else float("inf"))


def _diff(a: list[float], b: list[float]) -> tuple[float, tuple[float, float]]:
    """mean(b) - mean(a) and its 95% interval (normal approximation, unequal variances)."""
    (ma, va), (mb, vb) = _mean_var(a), _mean_var(b)
    se = math.sqrt(va / max(len(a), 1) + vb / max(len(b), 1))
    return mb - ma, (mb - ma - 1.96 * se, mb - ma + 1.96 * se)


def compare_versions(trace_root, stable: int, canary: int, since: datetime | None = None,
                     margin: float = 0.05, logprob_margin: float = 0.5) -> CanaryComparison:
    rows = read_traces(trace_root, weight_versions=[stable, canary], since=since,
                       columns=["episode_id", "weight_version", "status", "completion_logprobs"]).to_pylist()
    rewards = {f["episode_id"]: f["reward"] for f in read_feedback(trace_root).to_pylist()
               if f["episode_id"] and f["reward"] is not None}
    versions: dict[str, set[int]] = {}
    tokens: dict[str, list[float]] = {}
    for r in rows:
        if r["status"] != "ok" or not r["episode_id"]:
            continue
        versions.setdefault(r["episode_id"], set()).add(r["weight_version"])
        tokens.setdefault(r["episode_id"], []).extend(r["completion_logprobs"] or [])
    reward = {stable: [], canary: []}
    logprob = {stable: [], canary: []}
    for ep, vs in versions.items():
        if len(vs) != 1:  # an episode across versions (a lone server's swap) judges neither
            continue
        v = next(iter(vs))
        if ep in rewards:  # judged episodes only: traffic without feedback mixes in other prompts
            reward[v].append(float(rewards[ep]))
            if tokens[ep]:
                logprob[v].append(sum(tokens[ep]) / len(tokens[ep]))

    def stats(v: int) -> VersionStats:
        (r, rv), (lp, lv) = _mean_var(reward[v]), _mean_var(logprob[v])
        return VersionStats(len(reward[v]), r, rv, len(logprob[v]), lp, lv)

    (dr, ri), (dl, li) = _diff(reward[stable], reward[canary]), _diff(logprob[stable], logprob[canary])
    return CanaryComparison(stats(stable), stats(canary), dr, ri, dl, li, margin, logprob_margin)
