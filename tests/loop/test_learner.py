"""loop.train_from: learner: a candidate rejected only for want of proof keeps training; anything
else (a promotion, a measured loss, another failed check, a server that moved) resets it."""

from __future__ import annotations

import json
import shutil

import pytest

from loop.config import LoopConfig
from loop.learner import next_learner, train_parent
from loop.state import LoopState

SHORT = ["paired success delta -0.010 (se 0.043): its 90% lower bound -0.065 is not above "
         "validate.min_success_delta -0.05"]


def cfg(train_from="learner"):
    c = LoopConfig()
    c.loop.train_from = train_from
    return c


def summary(delta, failed=True):
    return {"success_delta": delta, "success_failed": failed}


def test_a_candidate_rejected_for_want_of_proof_stays_the_learner():
    got = next_learner(cfg(), 4, summary(-0.01), False, SHORT, "/ck/4", "/fp/serving", "rejected")
    assert got == {"fp": "/ck/4", "serving_fp": "/fp/serving", "cycle": 4, "delta": -0.01}
    # at the margin it stays; below it the gate measured a loss: back to serving
    assert next_learner(cfg(), 4, summary(-0.05), False, SHORT, "/ck/4", "/fp", "rejected")
    assert next_learner(cfg(), 4, summary(-0.06), False, SHORT, "/ck/4", "/fp", "rejected") == {}


@pytest.mark.parametrize("case", ["promoted", "other_check", "two_reasons", "no_success_test", "rolled_back",
                                  "train_from_serving"])
def test_anything_else_resets_the_learner_to_serving(case):
    args = dict(c=cfg(), summary=summary(0.02), passed=False, reasons=SHORT, outcome="rejected")
    if case == "promoted":
        args |= dict(passed=True, reasons=[], outcome="serving")
    elif case == "other_check":  # damage, drift, the engine check, the floor: the success test passed
        args |= dict(summary=summary(0.02, failed=False), reasons=["drift kl_mean 0.3 > validate.max_drift_kl_mean 0.25"])
    elif case == "two_reasons":
        args |= dict(reasons=SHORT + ["quant kl_p99 0.3 > validate.max_quant_kl_p99 0.25"])
    elif case == "no_success_test":  # the gate stopped before its engine stage
        args |= dict(summary={}, reasons=["candidate rejected before any forward: ..."])
    elif case == "rolled_back":
        args |= dict(outcome="rolled_back")
    else:
        args |= dict(c=cfg("serving"))
    a = args
    assert next_learner(a["c"], 2, a["summary"], a["passed"], a["reasons"], "/ck/2", "/fp", a["outcome"]) == {}


def test_the_next_cycle_trains_the_learner_while_the_same_weights_serve(tiny_base, tmp_path, capsys):
    learner = tmp_path / "learner"
    shutil.copytree(tiny_base.path, learner)
    state = LoopState("x", "", {}, path=str(tmp_path / "loop_state.json"))
    state.learner = {"fp": str(learner), "serving_fp": tiny_base.path, "cycle": 3, "delta": 0.01}
    assert train_parent(cfg("serving"), state, tiny_base.path) == tiny_base.path  # the default ignores it
    assert train_parent(cfg(), state, tiny_base.path) == str(learner)
    assert "training the learner" in capsys.readouterr().out
    # a rollback or a restarted server moved what serves: the learner grew on other weights
    assert train_parent(cfg(), state, str(tmp_path / "other")) == str(tmp_path / "other")
    assert state.learner == {} and json.loads((tmp_path / "loop_state.json").read_text())["learner"] == {}  # saved
    # a learner folder that is gone: from serving, said
    state.learner = {"fp": str(tmp_path / "gone"), "serving_fp": tiny_base.path, "cycle": 3, "delta": 0.0}
    assert train_parent(cfg(), state, tiny_base.path) == tiny_base.path and "no longer serves" in capsys.readouterr().out


def test_train_from_is_checked_by_name():
    from loop.config import load_config
    from loop.configs import ConfigError

    with pytest.raises((ConfigError, ValueError), match="train_from"):
        load_config("conf/tiny.yaml", ["loop.train_from=newest"])
    assert load_config("conf/tiny.yaml", ["loop.train_from=learner"]).loop.train_from == "learner"
