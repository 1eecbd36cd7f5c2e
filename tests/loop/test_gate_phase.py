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


def test_the_training_parent_is_what_the_server_serves(tiny_base, tmp_path, capsys):
    """After a `loop rollback` (or a restarted external server) the server serves another version
    than the state recorded: on c8fb06b the cycle trained the state's `fp` anyway."""
    from types import SimpleNamespace

    from loop.cycle import serving_parent
    from loop.serving import serving_spec
    from loop.state import LoopState
    from pipelines.quantize import quantize_checkpoint

    spec = serving_spec("w4a16", 32, "bfloat16")
    served_base = quantize_checkpoint(tiny_base.path, tmp_path / "base-q", spec, parent=tiny_base.path).path
    other_fp = tmp_path / "other-fp"
    import shutil

    shutil.copytree(tiny_base.path, other_fp)
    other = quantize_checkpoint(other_fp, tmp_path / "other-q", spec, parent=str(other_fp)).path
    state = LoopState("x", "", {}, path=str(tmp_path / "loop_state.json"))
    state.serving = {"path": tiny_base.path, "fp": tiny_base.path, "version": "3"}
    lp = SimpleNamespace(state=state)
    # the served (quantized) copy of the state's policy: the same parent, nothing said, nothing changed
    assert serving_parent(lp, {"path": served_base, "weight_version": 4}) == tiny_base.path
    assert state.serving["version"] == "3" and "not" not in capsys.readouterr().out
    # another version serves: train from its full-precision parent, and the state follows the server
    assert serving_parent(lp, {"path": other, "weight_version": 5}) == str(other_fp)
    assert state.serving == {"path": other, "fp": str(other_fp), "version": None}
    assert "as the state said" in capsys.readouterr().out


def test_a_window_the_parent_never_served_is_not_trained_on(ds_episodes, ds_traces, ds_write, tmp_path):
    from types import SimpleNamespace

    from loop.cycle import window_served_by

    _, ep = ds_episodes[0]
    ds_write(tmp_path / "data", ds_traces(ep, "w-0-0", versions=[3, 3]))  # served by sha 0...0 as version 3
    cfg = SimpleNamespace(serve=SimpleNamespace(trace_root=str(tmp_path / "data")))
    assert window_served_by(cfg, SimpleNamespace(weight_versions=(3,)), "0" * 64)
    assert not window_served_by(cfg, SimpleNamespace(weight_versions=(3,)), "1" * 64)
    assert not window_served_by(cfg, SimpleNamespace(weight_versions=(4,)), "0" * 64)
