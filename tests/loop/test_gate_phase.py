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
    cfg = SimpleNamespace(serve=SimpleNamespace(trace_root=str(tmp_path / "data")),
                          collect=SimpleNamespace(source="traffic", max_staleness=0))
    assert window_served_by(cfg, SimpleNamespace(weight_versions=(3,)), "0" * 64)
    assert not window_served_by(cfg, SimpleNamespace(weight_versions=(3,)), "1" * 64)
    assert not window_served_by(cfg, SimpleNamespace(weight_versions=(4,)), "0" * 64)
    cfg.collect.max_staleness = 1  # traffic the version before served while the last cycle trained: trained on
    assert window_served_by(cfg, SimpleNamespace(weight_versions=(3,)), "1" * 64)


def test_your_agents_candidates_are_gated_on_your_tasks_not_the_calculator(tiny_base, tiny_cfg, gate_dataset,
                                                                          monkeypatch, tmp_path):
    """With `task.agent` the gate's engine stage plays no built-in problem (log-probs only), OPE on
    the logged episodes decides, and your eval split, played through both versions, is the paired
    measurement beside it; no built-in success floor applies. On b774e0a the engine stage's child
    (`loop eval` on a config with `task.agent`) played your agent's eval and wrote no log-probs:
    FileNotFoundError out of the gate, the cycle stopped."""
    import dataclasses
    import json

    import loop.gate as lg
    from loop.bootstrap import TaskConfig

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for split in ("train", "eval"):
        (tasks / f"{split}.jsonl").write_text("".join(json.dumps({"question": f"{i}+1", "answer": i + 1}) + "\n"
                                                      for i in range(4)))
    (tmp_path / "agent.py").write_text("async def play(task, client):\n    return 1.0\n")
    cfg = dataclasses.replace(tiny_cfg, task=TaskConfig(agent=f"{tmp_path / 'agent.py'}:play", source=str(tasks)))
    played = []

    def agent_eval(c, model):  # your agent through a server of each version (served in its own test)
        played.append(model)
        return {"by_task": [1.0, 0.0, None, 1.0] if model == "cand" else [0.0, 0.0, 1.0, 1.0]}

    monkeypatch.setattr("loop.evaluate.agent_eval", agent_eval)
    seqs = lg.heldout(cfg, gate_dataset.path)
    engine, res = lg.engine_side(cfg, tiny_base.path, seqs, 512, tmp_path, tiny_base.path, "gate-0-1", best=(0.9, None))
    assert engine.success is None and engine.paired is None and engine.num_problems == 0 and "T=1.0" not in res
    assert engine.logprobs.shape[0] == sum(sum(m[1:]) for m in seqs.sampled)  # the engine stage's log-probs
    from loop.evaluate import agent_paired

    assert agent_paired(cfg, "cand", "srv")[:2] == ([1.0, 0.0, 1.0], [0.0, 0.0, 1.0]) and played == ["cand", "srv"]

    monkeypatch.setattr(lg, "engine_side", lambda *a, **k: (dataclasses.replace(engine), res))
    monkeypatch.setattr("loop.evaluate.agent_paired", lambda c, cand, srv: ([1.0, 0.0, 1.0], [0.0, 0.0, 1.0], 1.0))
    g = lg.gate(cfg, tiny_base.path, None, tiny_base.path, seqs, tmp_path, tmp_path / "gate", eval_seed="gate-0-1",
                best=(0.9, None), ope_seqs=lg.heldout(cfg, gate_dataset.path, 512))
    r = g.report
    assert r.passed, r.reasons  # OPE decides (itself against itself), the floor of 0.9 is the built-in task's
    assert r.success["source"] == "ope" and r.eval["success_delta"] == pytest.approx(1 / 3)
    assert r.eval["candidate_success"] == pytest.approx(2 / 3) and r.eval["source"].endswith("eval split")
    assert "success 66.7% vs 33.3%" in r.summary_line()


def test_ope_reads_the_runs_earlier_heldout_episodes_newest_first(tiny_cfg, gate_dataset, tmp_path):
    """The cycle's own held-out episodes first, then earlier datasets' of the run (never trained on),
    newest first; none later than the candidate's; at most validate.ope_datasets datasets and
    validate.ope_sequences episodes; a folder that is no finished dataset is passed over."""
    import dataclasses
    import shutil

    import loop.gate as lg

    names = ["20260101T000000Z-a", "20260102T000000Z-b", "20260103T000000Z-c", "20260104T000000Z-d"]
    for name in names:
        shutil.copytree(gate_dataset.path, tmp_path / "datasets" / name)
    (tmp_path / "datasets" / "20260102T120000Z-killed").mkdir()
    n = len(lg.heldout(tiny_cfg, gate_dataset.path, 512).ids)
    own = str(tmp_path / "datasets" / names[2])
    got = lg.ope_heldout(tiny_cfg, own, tmp_path)
    assert [s.source.split("/")[-1].split(":")[0] for s in got] == [names[2], names[1], names[0]]
    cfg = dataclasses.replace(tiny_cfg, validate=dataclasses.replace(tiny_cfg.validate, ope_datasets=2))
    assert len(lg.ope_heldout(cfg, own, tmp_path)) == 2
    cfg = dataclasses.replace(tiny_cfg, validate=dataclasses.replace(tiny_cfg.validate, ope_sequences=n + 1))
    capped = lg.ope_heldout(cfg, own, tmp_path)
    assert [len(s.ids) for s in capped] == [n, 1]


def test_the_best_versions_floor_is_taken_relative_to_serving(tmp_path):
    """The floor against the best promoted version: its recorded success (its own gate's problems,
    selected for reading high) less serving's recorded one, added by the engine to serving's success
    on this gate's problems; the base (no record) falls back to the best's record."""
    from pipelines.promote import Registry
    from pipelines.validate import best_here

    registry = Registry(f"sqlite:///{tmp_path / 'mlflow.db'}", "policy")
    base = registry.register(str(tmp_path / "base"), {})
    assert registry.best_above(base) is None  # nothing promoted yet: no floor
    v2, v3 = (registry.register(str(tmp_path / n), {}) for n in ("v2", "v3"))
    registry.tag(v2.version, promoted_success=0.525)
    registry.tag(v3.version, promoted_success=0.455)
    get = lambda v: registry.client.get_model_version(registry.name, v.version)  # noqa: E731
    assert registry.best_above(get(v2)) == (0.525, 0.0)
    best, gap = registry.best_above(get(v3))
    assert best == 0.525 and gap == pytest.approx(0.07)
    assert registry.best_above(get(base)) == (0.525, None)
    # serving played 41.5% here: the best is taken at 41.5% + 7 points, not at its own 52.5%
    assert best_here((best, gap), 0.415) == pytest.approx(0.485)
    assert best_here((0.525, None), 0.415) == 0.525 and best_here((0.525, 0.07), None) == 0.525
    assert best_here(None, 0.415) is None
