"""Success by cycle, what the loop's run plots: the base from the first validated cycle, a cycle
with nothing to train on keeps what served, a rejected candidate is shown but not served."""

from loop.cycle import success_by_cycle
from loop.state import CycleState, LoopState


def _cycle(k: int, outcome: str, serving: float | None = None, candidate: float | None = None) -> CycleState:
    done = {"collect": {}}
    if serving is not None:
        done["validate"] = {"summary": {"serving_success": serving, "candidate_success": candidate}}
    return CycleState(k, done=done, outcome=outcome)


def test_no_signal_first_cycle_then_promoted_then_rejected():
    state = LoopState("id", "sha", {}, cycles=[_cycle(1, "no_signal"), _cycle(2, "serving", 0.30, 0.40),
                                               _cycle(3, "rejected", 0.40, 0.35), CycleState(4)])
    assert success_by_cycle(state) == [
        {"cycle": 0, "served": 0.30, "candidate": None, "outcome": "base"},
        {"cycle": 1, "served": 0.30, "candidate": None, "outcome": "no_signal"},
        {"cycle": 2, "served": 0.40, "candidate": 0.40, "outcome": "serving"},
        {"cycle": 3, "served": 0.40, "candidate": 0.35, "outcome": "rejected"}]  # cycle 4 not finished


def test_nothing_validated_yet_plots_nothing():
    assert success_by_cycle(LoopState("id", "sha", {}, cycles=[_cycle(1, "no_signal")])) == []
