"""Is the canary worse than stable on its own live traffic? From the traces and feedback alone.

    c = compare_versions(trace_root, stable=3, canary=4, since=t0, margin=0.05)
    c.passed, c.reward_diff, c.interval, c.logprob_diff

Each episode (its turns all carry one weight version: the fleet pins it) counts once, with its
reward from the feedback store (episodes without one are left out). The canary passes when the
lower end of the 95% interval of (canary - stable) mean reward is above -margin: a canary is
promoted on evidence that it is not worse, so too little traffic fails it (and rolls it back), as
does a clearly worse one. The mean behaviour logprob of the sampled tokens is reported beside it
(each version's own policy on its own traffic: a collapse, or a sudden drift, shows there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

from rollout.traces import read_feedback, read_traces


@dataclass(frozen=True)
class VersionStats:
    episodes: int
    reward: float  # mean episode reward
    reward_var: float
    logprob: float  # mean logprob of the sampled tokens


@dataclass(frozen=True)
class CanaryComparison:
    stable: VersionStats
    canary: VersionStats
    reward_diff: float  # canary - stable
    interval: tuple[float, float]  # 95%, normal approximation (Welch)
    logprob_diff: float
    margin: float

    @property
    def passed(self) -> bool:
        return self.interval[0] > -self.margin

    def summary(self) -> str:
        return (f"canary {self.canary.reward:.3f} ({self.canary.episodes} episodes) vs stable {self.stable.reward:.3f} "
                f"({self.stable.episodes}): {self.reward_diff:+.3f} [{self.interval[0]:+.3f}, {self.interval[1]:+.3f}], "
                f"token logprob {self.logprob_diff:+.3f}: {'pass' if self.passed else 'fail'} (margin {self.margin})")


def _stats(rewards: list[float], logprobs: list[float]) -> VersionStats:
    n = len(rewards)
    mean = sum(rewards) / n if n else float("nan")
    var = sum((r - mean) ** 2 for r in rewards) / (n - 1) if n > 1 else float("inf")
    return VersionStats(n, mean, var, sum(logprobs) / len(logprobs) if logprobs else float("nan"))


def compare_versions(trace_root, stable: int, canary: int, since: datetime | None = None,
                     margin: float = 0.05) -> CanaryComparison:
    rows = read_traces(trace_root, weight_versions=[stable, canary], since=since,
                       columns=["episode_id", "weight_version", "status", "completion_logprobs"]).to_pylist()
    rewards = {f["episode_id"]: f["reward"] for f in read_feedback(trace_root).to_pylist()
               if f["episode_id"] and f["reward"] is not None}
    versions: dict[str, set[int]] = {}
    lps: dict[int, list[float]] = {stable: [], canary: []}
    for r in rows:
        if r["status"] != "ok" or not r["episode_id"]:
            continue
        versions.setdefault(r["episode_id"], set()).add(r["weight_version"])
        if r["weight_version"] in lps:
            lps[r["weight_version"]] += r["completion_logprobs"] or []
    per: dict[int, list[float]] = {stable: [], canary: []}
    for ep, vs in versions.items():
        if len(vs) == 1 and (v := next(iter(vs))) in per and ep in rewards:
            per[v].append(float(rewards[ep]))
    s, c = _stats(per[stable], lps[stable]), _stats(per[canary], lps[canary])
    diff = c.reward - s.reward
    se = math.sqrt(s.reward_var / max(s.episodes, 1) + c.reward_var / max(c.episodes, 1))
    return CanaryComparison(s, c, diff, (diff - 1.96 * se, diff + 1.96 * se), c.logprob - s.logprob, margin)
