"""`loop run` end to end on the tiny config: bootstrap (reused from the session's build), base
success measured through vLLM, and an MLflow run with metrics and plots in a real sqlite store."""

import subprocess
import sys

import pytest


def test_config_error_exits_2_with_the_key(tmp_path):
    out = subprocess.run([sys.executable, "-m", "loop.cli", "run", "conf/tiny.yaml", "bootstrap.sft.lrr=1"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "conf/tiny.yaml: bootstrap.sft.lrr: unknown key" in out.stderr


@pytest.mark.slow
def test_loop_run_gets_through_bootstrap(tiny_base, tiny_cfg, tmp_path):
    import mlflow

    cache = tiny_cfg.bootstrap.cache_dir
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "loop.cli", "run", "conf/tiny.yaml", f"bootstrap.cache_dir={cache}",
         f"run_dir={run_dir}"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"base model {tiny_base.path}" in out.stdout
    client = mlflow.tracking.MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name(tiny_cfg.mlflow.experiment)
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.tags["phase"] == "bootstrap"
    assert 0.0 <= run.data.metrics["base/vllm_greedy"] <= 1.0 and "base/vllm_t1" in run.data.metrics
    assert len(client.get_metric_history(run.info.run_id, "sft/loss")) == tiny_base.sft_steps
    assert {a.path for a in client.list_artifacts(run.info.run_id, "plots")} >= {"plots/sft_loss.png"}
