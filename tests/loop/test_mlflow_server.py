"""`loop run` against a real MLflow tracking server on PostgreSQL with proxied artifacts
(infra/mlflow/server.sh), and the server stopped mid-run: the loop retries, stops with a clear
error and loses nothing; rerun, it resumes where it stopped. Skips (saying why) only where
PostgreSQL's server binaries are not installed."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from test_cycles import REPO, loop_args

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
    reason="PostgreSQL's server is not installed (Debian: apt install postgresql)")]

SCRIPT = REPO / "infra" / "mlflow" / "server.sh"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server(cmd: str, folder: Path, ports: tuple[int, int] = ()) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", str(SCRIPT), cmd, str(folder), *map(str, ports)], capture_output=True, text=True,
                         env=env, timeout=180)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.fixture
def tracking():
    # not under pytest's tmp folders: they are private to this user, and as root the database
    # runs as `postgres`, which must reach its folder
    folder = Path(tempfile.mkdtemp(prefix="flywheel-mlflow-"))
    folder.chmod(0o755)
    ports = (free_port(), free_port())
    uri = server("start", folder, ports)
    yield uri, folder, ports
    server("stop", folder)
    shutil.rmtree(folder, ignore_errors=True)


def test_a_run_tracks_into_postgres_and_survives_the_server_stopping(tiny_cfg, tmp_path, tracking):
    import mlflow
    import psycopg

    uri, folder, ports = tracking
    run_dir = tmp_path / "run"
    args = loop_args(tiny_cfg, run_dir) + [f"mlflow.tracking_uri={uri}", "mlflow.http_retries=2",
                                           "mlflow.http_timeout_s=10", "loop.cycles=1"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # the run and its cycle tracked: stop the server while the cycle trains
        lines.append(line)
        if line.startswith("[loop] cycle 1/1 | train"):
            os.killpg(int((folder / "mlflow.pid").read_text()), 9)  # the server and its workers
            break
    t0 = time.monotonic()
    out = "".join(lines) + proc.communicate(timeout=600)[0]
    assert proc.returncode == 4, out[-3000:]
    assert time.monotonic() - t0 < 300
    assert f"[loop] stopped: the MLflow tracking server {uri} did not answer (mlflow.http_retries 2)" in out
    assert "the same command resumes it" in out and "Traceback" not in out

    server("start", folder, ports)  # the same database and artifact store
    again = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    assert "[loop] resuming run" in again.stdout

    client = mlflow.tracking.MlflowClient(uri)
    exp = client.get_experiment_by_name(tiny_cfg.mlflow.experiment)
    runs = client.search_runs([exp.experiment_id], "tags.loop_id != ''")
    cycles = sorted(r.data.tags.get("loop_cycle", "loop") for r in runs)
    assert cycles == ["1", "loop"], cycles  # resumed into the same runs, none twice
    cycle1 = next(r for r in runs if r.data.tags.get("loop_cycle") == "1")
    assert cycle1.data.metrics and cycle1.info.artifact_uri.startswith("mlflow-artifacts:/")
    # the artifacts went through the server into its store, not beside the run
    assert list((folder / "artifacts").rglob("*.json")) and not (run_dir / "artifacts").exists()
    with psycopg.connect(f"host=127.0.0.1 port={ports[1]} user=mlflow dbname=mlflow") as db:
        (n,), = db.execute("SELECT COUNT(*) FROM runs WHERE experiment_id = %s", (exp.experiment_id,)).fetchall()
    assert n == len(client.search_runs([exp.experiment_id])) > len(runs)  # the loop's, its cycles' and the bootstrap's
