"""The gate's success test: the candidate and the serving version on the same fresh problems.

    t = paired_test(candidate_outcomes, serving_outcomes, margin=-0.05, alpha=0.1)
    t.passed   # the candidate is not worse than serving by more than |margin|, at level alpha

Each problem is played once by each model (one engine process, the same sampling settings), so a
problem's difficulty cancels in its difference d_i = c_i - s_i. The test is one-sided
non-inferiority on the mean difference: H0 "delta <= margin" is rejected, and the candidate
promoted, when the (1 - alpha) lower confidence bound of the mean (normal approximation,
sd with ddof 1) lies above `margin`. Its false-promotion rate is about `alpha` for a candidate
truly |margin| worse (simulated at alpha 0.1, 200 problems: 9.4% with independent outcomes,
12.2% when a problem's difficulty correlates them: the normal approximation of a skewed
difference; tests/pipelines/test_paired.py), and falls fast below that (10 points worse: < 1%;
bench/gate_power.py measures it on planted candidates through the engine). With margin 0 a candidate must be shown better; with margin < 0 an equal one passes
about as often as it is measured above -|margin| + z * se.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist


@dataclass(frozen=True)
class PairedTest:
    n: int  # problems, each played once by each model
    candidate: float  # mean success
    serving: float
    delta: float  # mean of candidate - serving
    se: float  # its standard error
    lower: float  # the one-sided (1 - alpha) lower bound of delta
    margin: float  # H0: delta <= margin
    alpha: float  # the stated false-promotion rate at delta = margin
    passed: bool

    def to_dict(self) -> dict:
        return asdict(self)


def paired_test(candidate: list[float], serving: list[float], margin: float, alpha: float) -> PairedTest:
    if len(candidate) != len(serving) or len(candidate) < 2:
        raise ValueError(f"paired outcomes need the same problems, at least 2: got {len(candidate)} and {len(serving)}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    n = len(candidate)
    d = [c - s for c, s in zip(candidate, serving)]
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    se = sd / math.sqrt(n)
    lower = mean - NormalDist().inv_cdf(1 - alpha) * se
    return PairedTest(n, sum(candidate) / n, sum(serving) / n, mean, se, lower, margin, alpha,
                      round(lower, 12) > margin)
