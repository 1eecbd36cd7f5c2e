"""`loop status` and `loop ui`: where a run stands, and the MLflow UI on its store.

    loop status CONFIG   the serving version and its registry alias, the last cycles' decisions,
                         success and KL, and where the traces and the MLflow store are
    loop ui CONFIG       the MLflow UI on the run's store: one worker, no background job runners
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def status_lines(cfg, last: int = 5) -> list[str]:
    from loop.cycle import success_by_cycle
    from loop.state import load

    state = load(cfg.run_dir)
    lines = [f"run_dir      {Path(cfg.run_dir).resolve()}",
             f"traces       {Path(cfg.serve.trace_root).resolve()}/traces (feedback beside)",
             f"mlflow       {cfg.tracking_uri} (experiment {cfg.mlflow.experiment}; `loop ui` opens it)"]
    lines.append(f"registry     {_registry_line(cfg)}")
    if state is None:
        return lines + ["loop         no `loop run` in this run_dir yet"]
    done = sum(c.finished for c in state.cycles)
    lines.append(f"loop         run {state.loop_id}: {done} of {state.config.get('loop.cycles')} cycles done"
                 f"{'' if state.finished else ' (unfinished: `loop run` with the same config continues it)'}")
    if state.serving:
        lines.append(f"serving      {state.serving['path']}"
                     f"{' (registry v' + str(state.serving['version']) + ')' if state.serving.get('version') else ' (the base)'}")
    rows = {r["cycle"]: r for r in success_by_cycle(state)}
    if 0 in rows:
        lines.append(f"cycle 0      the base as served: eval success {rows[0]['served']:.1%}")
    for c in state.cycles[-last:]:
        s = c.done.get("validate", {}).get("summary", {})
        if not c.finished:
            lines.append(f"cycle {c.k:<6} under way: done {', '.join(c.done) or 'nothing yet'}")
            continue
        success = s.get("candidate_success")
        kl = s.get("kl_drift_mean")
        lines.append(f"cycle {c.k:<6} {c.outcome:<12} eval success {'n/a' if success is None else f'{success:.1%}'}"
                     f" | drift KL {'n/a' if kl is None else f'{kl:.2e}'} | {sum(c.timings.values()):.0f}s"
                     f" | {c.reason[:120]}")
    return lines


def _registry_line(cfg) -> str:
    """The versions the aliases name, read without creating anything."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    if cfg.mlflow.tracking_uri is None and not (Path(cfg.run_dir) / "mlflow.db").is_file():
        return "no store yet"
    client = MlflowClient(tracking_uri=cfg.tracking_uri, registry_uri=cfg.tracking_uri)
    name = cfg.promote.model_name
    try:
        model = client.get_registered_model(name)
    except MlflowException:
        return f"{name}: not registered yet"
    aliases = ", ".join(f"{a} v{v}" for a, v in sorted(model.aliases.items(), key=lambda x: int(x[1]))) or "no aliases"
    return f"{name}: {aliases}"


def ui_command(cfg, port: int, host: str = "127.0.0.1") -> tuple[list[str], dict]:
    """`mlflow ui` on the run's store, light: one worker and no job runners (the default starts a
    worker pool and job-consumer processes beside it)."""
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", cfg.tracking_uri, "--host", host,
           "--port", str(port), "--workers", "1"]
    return cmd, {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
