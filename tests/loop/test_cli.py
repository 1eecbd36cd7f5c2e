"""`loop run` end to end on the tiny config: bootstrap (reused from the session's build), base
success measured through vLLM, then collect (a real `loop serve` child, episodes over HTTP),
build_dataset (the traces it wrote), train (GRPO on a real local Ray runtime), then requantize,
validate (the KL gate, its engine stage in a child vLLM) and promote into the cycle's server
through the MLflow registry, each phase group an MLflow run in a real sqlite store."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


def test_config_error_exits_2_with_the_key(tmp_path):
    out = subprocess.run([sys.executable, "-m", "loop.cli", "run", "conf/tiny.yaml", "bootstrap.sft.lrr=1"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "conf/tiny.yaml: bootstrap.sft.lrr: unknown key" in out.stderr


@pytest.mark.slow
def test_loop_run_bootstraps_collects_builds_trains_gates_and_promotes(tiny_base, tiny_cfg, plant, tmp_path):
    import mlflow
    import pyarrow.parquet as pq

    cache = tiny_cfg.bootstrap.cache_dir
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "loop.cli", "run", "conf/tiny.yaml", f"bootstrap.cache_dir={cache}",
         f"run_dir={run_dir}", f"serve.trace_root={tmp_path / 'data'}", "collect.num_problems=4",
         "collect.rollout.group_size=8", "collect.rollout.max_tokens=32",
         # groups hash their collection round (a fresh run id): split 32 episodes, not 4 groups, so
         # both sides are non-empty but for a 0.75^32 (1e-4) chance; ~6 train episodes a group at
         # the tiny model's ~75% tool-call rate leave all 4 groups without signal ~0.1% of runs
         "dataset.heldout_unit=episode", "dataset.heldout_fraction=0.25"],
        capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"base model {tiny_base.path}" in out.stdout
    assert "collected 32 episodes (32 ok)" in out.stdout, out.stdout[-2000:]
    client = mlflow.tracking.MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name(tiny_cfg.mlflow.experiment)
    runs = {r.data.tags["phase"]: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"bootstrap", "collect", "train", "requantize", "validate", "promote"}
    assert all(r.info.artifact_uri.startswith((run_dir / "artifacts").resolve().as_uri()) for r in runs.values())

    boot = runs["bootstrap"]
    assert 0.0 <= boot.data.metrics["base/vllm_greedy"] <= 1.0 and "base/vllm_t1" in boot.data.metrics
    assert len(client.get_metric_history(boot.info.run_id, "sft/loss")) == tiny_base.sft_steps
    assert {a.path for a in client.list_artifacts(boot.info.run_id, "plots")} >= {"plots/sft_loss.png"}

    col = runs["collect"]
    m = col.data.metrics
    assert m["collect/episodes"] == 32 and m["collect/episodes_ok"] == 32 and m["collect/episodes_per_s"] > 0
    # every collected episode came back from the server's traces into the dataset, none dropped
    assert m["dataset/train_episodes"] + m["dataset/heldout_episodes"] == 32
    assert m["dataset/heldout_episodes"] > 0 and m["dataset/train_episodes"] > 0
    assert not any(v for k, v in m.items() if k.startswith("dataset/dropped"))
    assert {a.path for a in client.list_artifacts(col.info.run_id, "plots")} == {"plots/group_success.png"}
    manifest = json.loads(mlflow.artifacts.load_text(f"{col.info.artifact_uri}/dataset_manifest.json"))
    collected = json.loads(mlflow.artifacts.load_text(f"{col.info.artifact_uri}/collect_manifest.json"))
    assert manifest["path"] == col.data.tags["dataset_path"] and manifest["parent"]["weight_versions"] == [0]
    assert sum(collected["group_successes"]) == round(32 * collected["success"])
    rows = [r for split in ("train", "heldout") for f in sorted((run_dir / "datasets").glob(f"*/{split}/*.parquet"))
            for r in pq.read_table(f, columns=["episode_id", "group_id", "reward"]).to_pylist()]
    assert sorted(r["episode_id"] for r in rows) == sorted(f"{collected['run_id']}-{g}-{s}"
                                                            for g in range(4) for s in range(8))
    assert len({r["group_id"] for r in rows}) == 4
    # conf/tiny.yaml scores with the shaped reward: 1 for a right answer, 0.2 for the tool call alone
    assert sum(r["reward"] == 1.0 for r in rows) == sum(collected["group_successes"])
    assert {r["reward"] for r in rows} <= {0.0, 0.2, 1.0}

    train = runs["train"]
    ckpt = json.loads(mlflow.artifacts.load_text(f"{train.info.artifact_uri}/checkpoint_manifest.json"))
    assert ckpt["path"] == train.data.tags["checkpoint_path"] and ckpt["dataset"] == manifest["path"]
    assert (Path(ckpt["path"]) / "flywheel_manifest.json").is_file() and ckpt["world_size"] == 1
    steps = ckpt["metrics"]["steps"]
    assert steps >= 1 and len(client.get_metric_history(train.info.run_id, "train/loss")) == steps
    for key in ("train/mismatch/train_vs_behaviour", "train/is/mean", "train/grad_norm", "train/tokens_per_s"):
        assert len(client.get_metric_history(train.info.run_id, key)) == steps, key
    assert {a.path for a in client.list_artifacts(train.info.run_id, "plots")} >= {"plots/loss.png"}

    # requantize (serve.quant none here: the trained folder serves as it is) -> validate -> promote
    assert runs["requantize"].data.tags["served_path"] == ckpt["path"]
    val, prom = runs["validate"], runs["promote"]
    report = json.loads(mlflow.artifacts.load_text(f"{val.info.artifact_uri}/gate/gate_report.json"))
    assert report["candidate"] == ckpt["path"] and report["heldout"]["source"].endswith(":heldout")
    assert val.data.metrics["gate/passed"] == float(report["passed"])
    if report["passed"]:  # the tiny policy after 2 epochs: its drift is small, but not certain to pass
        assert report["stage"] == "engine" and report["engine_check"]["ok"]
        assert 0 <= report["eval"]["candidate_success"] <= 1 and report["eval"]["serving_success"] is not None
    version = client.get_registered_model("flywheel-policy").aliases["candidate"]
    assert prom.data.tags["outcome"] == ("serving" if report["passed"] else "rejected")
    assert client.get_model_version("flywheel-policy", version).source == ckpt["path"]
    assert f"cycle done: {prom.data.tags['outcome']} (registry v{version})" in out.stdout

    # the gate by hand, on a candidate whose tokenizer differs: refused before any engine starts
    plant_damage, _, _ = plant
    bad = plant_damage(ckpt["path"], "tokenizer", tmp_path / "bad")
    out = subprocess.run([sys.executable, "-m", "loop.cli", "validate", "conf/tiny.yaml", tiny_base.path, str(bad),
                          f"run_dir={run_dir}", "--dataset", manifest["path"]], capture_output=True, text=True)
    assert out.returncode == 1 and "tokenizer differs from the serving model" in out.stdout, out.stdout + out.stderr


@pytest.mark.slow
def test_loop_eval_measures_the_served_checkpoint(tiny_base, tiny_cfg, tiny_llm, tiny_tokenizer, tmp_path):
    """Greedy success through `loop eval` (its own engine, a child process) is the shared engine's
    on the same eval split (up to a problem or two: vLLM's CPU batches are not bit-invariant)."""
    from loop.evaluate import served_success
    from rollout.engine import vllm_generate
    from rollout.episode import run_episodes, success_rate
    from rollout.task import make_problems

    problems = make_problems("eval", tiny_cfg.task.num_eval_problems, tiny_cfg.task.seed)
    here = success_rate(run_episodes(problems, tiny_tokenizer, vllm_generate(tiny_llm), temperature=0.0))

    r = served_success("conf/tiny.yaml", tiny_base.path, "none", [f"bootstrap.cache_dir={tiny_cfg.bootstrap.cache_dir}",
                                                                  f"run_dir={tmp_path}"], temperatures=(0.0,))
    assert r["fmt"] == "none" and r["num_problems"] == len(problems)
    assert abs(r["T=0.0"] - here) <= 2 / len(problems), (r, here)
    out = subprocess.run([sys.executable, "-m", "loop.cli", "eval", "conf/tiny.yaml", str(tmp_path / "nowhere")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "is not a Hugging Face folder" in out.stderr
