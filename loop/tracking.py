"""MLflow tracking: one run per loop phase group, params from the config, plots as artifacts."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from loop.configs import flatten, to_dict


@contextmanager
def start_run(cfg, run_name: str, tags: dict | None = None):
    """A phase's MLflow run. Inside an active run (a loop cycle's, loop/cycle.py) the phase logs
    into that one, its tags prefixed with its name (`train.qat`); alone, it opens a run of its own
    with the resolved config as params."""
    import mlflow

    tags = tags or {}
    if mlflow.active_run() is not None:
        prefix = tags.get("phase", run_name)
        mlflow.set_tags({f"{prefix}.{k}": v for k, v in tags.items() if k != "phase"})
        yield mlflow.active_run()
        return
    with open_run(cfg, run_name, tags) as run:
        yield run


def use_store(cfg) -> str:
    """Point MLflow at the config's tracking store and experiment (a server's requests retried and
    timed out as `mlflow.http_retries` / `http_timeout_s` say; children inherit it); the experiment's id."""
    import mlflow

    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = str(cfg.mlflow.http_retries)
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(cfg.mlflow.http_timeout_s)
    mlflow.set_tracking_uri(cfg.tracking_uri)
    if cfg.mlflow.tracking_uri is None and mlflow.get_experiment_by_name(cfg.mlflow.experiment) is None:
        # the run's own store keeps its artifacts beside it, not in ./mlruns of whatever directory
        mlflow.create_experiment(cfg.mlflow.experiment,
                                 artifact_location=(Path(cfg.run_dir) / "artifacts").resolve().as_uri())
    return mlflow.set_experiment(cfg.mlflow.experiment).experiment_id


def open_run(cfg, run_name: str, tags: dict, run_id: str | None = None, nested: bool = False):
    """A new run with the resolved config as params (or `run_id` reopened, params as logged then);
    use with `with`."""
    import mlflow

    use_store(cfg)
    run = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_name, tags=tags, nested=nested)
    if run_id:
        return run
    params = {k: ("None" if v is None else v) for k, v in flatten(to_dict(cfg)).items()}
    mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
    return run


def unreachable(e: BaseException) -> bool:
    """Whether `e` is MLflow's client giving up on a tracking server that does not answer (its
    retries spent), as opposed to a request the server refused."""
    from mlflow.exceptions import MlflowException

    text = str(e)
    return isinstance(e, MlflowException) and "API request to" in text and any(
        s in text for s in ("Max retries exceeded", "Connection refused", "Read timed out", "RemoteDisconnected"))


def find_run(cfg, **tags) -> str | None:
    """The id of a run of the config's experiment with all of `tags`, or None (the loop's resume
    finds a run a killed `loop run` created but had not yet written down)."""
    import mlflow

    exp = use_store(cfg)
    query = " and ".join(f"tags.{k} = '{v}'" for k, v in tags.items())
    runs = mlflow.search_runs([exp], filter_string=query, output_format="list", max_results=1)
    return runs[0].info.run_id if runs else None


def log_curve(history: list[dict], key: str, name: str, title: str) -> None:
    """Plot `key` over steps from a history of {"step": s, key: v} and log it as an artifact."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import mlflow

    points = [(h["step"], h[key]) for h in history if key in h]
    if not points:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(*zip(*points), marker="." if len(points) < 50 else None)
    ax.set(xlabel="step", ylabel=key, title=title)
    ax.grid(alpha=0.3)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        fig.savefig(path, dpi=120, bbox_inches="tight")
        mlflow.log_artifact(str(path), artifact_path="plots")
    plt.close(fig)
