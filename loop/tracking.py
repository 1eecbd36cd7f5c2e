"""MLflow tracking: one run per loop phase group, params from the config, plots as artifacts."""

from __future__ import annotations

import tempfile
from pathlib import Path

from loop.configs import flatten, to_dict


def start_run(cfg, run_name: str, tags: dict | None = None):
    import mlflow

    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(cfg.tracking_uri)
    if cfg.mlflow.tracking_uri is None and mlflow.get_experiment_by_name(cfg.mlflow.experiment) is None:
        # the run's own store keeps its artifacts beside it, not in ./mlruns of whatever directory
        mlflow.create_experiment(cfg.mlflow.experiment,
                                 artifact_location=(Path(cfg.run_dir) / "artifacts").resolve().as_uri())
    mlflow.set_experiment(cfg.mlflow.experiment)
    run = mlflow.start_run(run_name=run_name, tags=tags or {})
    params = {k: ("None" if v is None else v) for k, v in flatten(to_dict(cfg)).items()}
    mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
    return run


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
