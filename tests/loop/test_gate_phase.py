"""loop.gate's composition, without engines: a dead engine stage fails the gate with its reason
(the cycle goes on and serving is untouched), and the held-out slice is required."""

from __future__ import annotations

import pytest


def test_a_dead_engine_stage_fails_the_gate(tiny_base, tiny_cfg, gate_dataset, monkeypatch, tmp_path):
    import loop.gate as lg

    def dead(*a, **k):
        raise RuntimeError("evaluation of X (none) failed:\nterminate called without an active exception")

    monkeypatch.setattr(lg, "engine_side", dead)
    seqs = lg.heldout(tiny_cfg, gate_dataset.path)
    g = lg.gate(tiny_cfg, tiny_base.path, None, tiny_base.path, seqs, tmp_path, tmp_path / "gate", eval_seed="gate-0-1")
    assert not g.report.passed and g.report.stage == "engine"
    assert g.report.reasons == ["engine stage failed: evaluation of X (none) failed:\n"
                                "terminate called without an active exception"]
    assert g.report.drift["kl"]["max"] == 0  # the twin stage ran and passed: itself against itself
    assert (tmp_path / "gate" / "gate_report.json").is_file()


def test_the_gate_needs_held_out_episodes(tiny_cfg, rl_dataset):
    import loop.gate as lg

    with pytest.raises(ValueError, match="dataset.heldout_fraction > 0"):
        lg.heldout(tiny_cfg, rl_dataset.path)  # built with heldout_fraction 0
