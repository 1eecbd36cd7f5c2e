"""`loop run` end to end on the tiny config: bootstrap (reused from the session's build), base
success measured through vLLM, then collect (a real `loop serve` child, episodes over HTTP) and
build_dataset (the traces it wrote), each phase group an MLflow run in a real sqlite store."""

import json
import subprocess
import sys

import pytest


def test_config_error_exits_2_with_the_key(tmp_path):
    out = subprocess.run([sys.executable, "-m", "loop.cli", "run", "conf/tiny.yaml", "bootstrap.sft.lrr=1"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "conf/tiny.yaml: bootstrap.sft.lrr: unknown key" in out.stderr


@pytest.mark.slow
def test_loop_run_bootstraps_collects_and_builds_the_dataset(tiny_base, tiny_cfg, tmp_path):
    import mlflow
    import pyarrow.parquet as pq

    cache = tiny_cfg.bootstrap.cache_dir
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "loop.cli", "run", "conf/tiny.yaml", f"bootstrap.cache_dir={cache}",
         f"run_dir={run_dir}", f"serve.trace_root={tmp_path / 'data'}", "collect.num_problems=3",
         "collect.rollout.group_size=4", "collect.rollout.max_tokens=32",
         # groups hash their collection round (a fresh run id): split 12 episodes, not 3 groups, so
         # both sides are non-empty but for a 2 x 0.5^12 chance
         "dataset.heldout_unit=episode", "dataset.heldout_fraction=0.5"],
        capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"base model {tiny_base.path}" in out.stdout
    assert "collected 12 episodes (12 ok)" in out.stdout, out.stdout[-2000:]
    client = mlflow.tracking.MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name(tiny_cfg.mlflow.experiment)
    runs = {r.data.tags["phase"]: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"bootstrap", "collect"}
    assert all(r.info.artifact_uri.startswith((run_dir / "artifacts").resolve().as_uri()) for r in runs.values())

    boot = runs["bootstrap"]
    assert 0.0 <= boot.data.metrics["base/vllm_greedy"] <= 1.0 and "base/vllm_t1" in boot.data.metrics
    assert len(client.get_metric_history(boot.info.run_id, "sft/loss")) == tiny_base.sft_steps
    assert {a.path for a in client.list_artifacts(boot.info.run_id, "plots")} >= {"plots/sft_loss.png"}

    col = runs["collect"]
    m = col.data.metrics
    assert m["collect/episodes"] == 12 and m["collect/episodes_ok"] == 12 and m["collect/episodes_per_s"] > 0
    # every collected episode came back from the server's traces into the dataset, none dropped
    assert m["dataset/train_episodes"] + m["dataset/heldout_episodes"] == 12
    assert m["dataset/heldout_episodes"] > 0 and m["dataset/train_episodes"] > 0
    assert not any(v for k, v in m.items() if k.startswith("dataset/dropped"))
    assert {a.path for a in client.list_artifacts(col.info.run_id, "plots")} == {"plots/group_success.png"}
    manifest = json.loads(mlflow.artifacts.load_text(f"{col.info.artifact_uri}/dataset_manifest.json"))
    collected = json.loads(mlflow.artifacts.load_text(f"{col.info.artifact_uri}/collect_manifest.json"))
    assert manifest["path"] == col.data.tags["dataset_path"] and manifest["parent"]["weight_versions"] == [0]
    assert sum(collected["group_successes"]) == round(12 * collected["success"])
    rows = [r for split in ("train", "heldout") for f in sorted((run_dir / "datasets").glob(f"*/{split}/*.parquet"))
            for r in pq.read_table(f, columns=["episode_id", "group_id", "reward"]).to_pylist()]
    assert sorted(r["episode_id"] for r in rows) == sorted(f"{collected['run_id']}-{g}-{s}"
                                                            for g in range(3) for s in range(4))
    assert len({r["group_id"] for r in rows}) == 3
    assert sum(r["reward"] for r in rows) == sum(collected["group_successes"])
