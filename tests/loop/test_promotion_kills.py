"""`loop run` against a server that outlives it (`collect.endpoint`), SIGKILLed where the side
effects are: right after the swap (before the state is saved), then right after the alias move.
Each rerun reconciles the recorded intent with `/admin/status`: the candidate is swapped in once,
a canary failure would restore the intent's `from` (never what happens to serve), the aliases
move by compare-and-set. The admin token comes from the environment and reaches no file under
the run and no MLflow param or tag."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
from pathlib import Path

import pytest

from test_cycles import loop_args, mlflow_client

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _status(server) -> dict:
    r = server.admin("GET", "/admin/status")
    assert r.status_code == 200, r.text
    return r.json()


def test_kills_after_the_swap_and_after_the_alias_move_are_reconciled(tiny_cfg, tiny_base, tmp_path):
    from rollout.server.process import ServerProcess
    from rollout.server.versions import read_ledger

    run_dir, token = tmp_path / "run", "tok-" + secrets.token_hex(12)
    cache = f"bootstrap.cache_dir={tiny_cfg.bootstrap.cache_dir}"
    args = loop_args(tiny_cfg, run_dir)
    server = ServerProcess(REPO / "conf" / "tiny.yaml", tiny_base.path, run_dir / "data", tmp_path / "server.log",
                           [cache, "serve.quant=auto", f"run_dir={run_dir}"], admin_token=token)
    with server:
        env = {**os.environ, "FLYWHEEL_ADMIN_TOKEN": token}
        args += [f"collect.endpoint={server.url}"]
        start = _status(server)

        out = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=REPO,
                             env={**env, "FLYWHEEL_FAILPOINTS": "promote:after_swap"})
        assert out.returncode == -signal.SIGKILL, out.stdout[-3000:] + out.stderr[-3000:]
        assert "[failpoint] promote:after_swap" in out.stdout
        state = json.loads((run_dir / "loop_state.json").read_text())
        c1 = state["cycles"][0]
        intent = c1["intent"]
        swapped = _status(server)  # the server survived the kill, serving the candidate
        assert "promote" not in c1["done"] and intent["from_sha"] == start["checkpoint_sha256"]
        assert swapped["checkpoint_sha256"] == intent["to_sha"] != intent["from_sha"]
        assert swapped["path"] == c1["done"]["requantize"]["path"]

        out = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=REPO,
                             env={**env, "FLYWHEEL_FAILPOINTS": "promote:after_alias"})
        assert out.returncode == -signal.SIGKILL, out.stdout[-3000:] + out.stderr[-3000:]
        assert "[failpoint] promote:after_alias" in out.stdout and "cycle 1/2 | train" not in out.stdout
        client = mlflow_client(run_dir)
        v1 = c1["done"]["validate"]["version"]
        assert str(client.get_registered_model("flywheel-policy").aliases["serving"]) == v1
        assert _status(server)["weight_version"] == swapped["weight_version"]  # not swapped twice

        out = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
        state = json.loads((run_dir / "loop_state.json").read_text())
        c1, c2 = state["cycles"]
        assert c1["outcome"] == "serving" and c1["done"]["promote"]["swap"]["resumed"] is True
        assert c2["done"]["train"]["parent"] == c1["done"]["requantize"]["fp"]
        final = _status(server)

    # one number, one checkpoint: the ledger and the traces agree, and no number was handed out twice
    ledger = read_ledger(run_dir / "data" / "weight_versions.jsonl")
    numbers = [e["version"] for e in ledger]
    assert len(numbers) == len(set(numbers)) and numbers == sorted(numbers)
    events = [e["event"] for e in ledger]
    assert events[0] == "start" and events.count("start") == 1  # the server was never restarted
    swaps = [e for e in ledger if e["event"].startswith("swap")]
    assert [e["checkpoint_sha256"] for e in swaps][:1] == [intent["to_sha"]]  # cycle 1's candidate, once
    assert ledger[-1]["checkpoint_sha256"] == final["checkpoint_sha256"]
    model = client.get_registered_model("flywheel-policy")
    serving = str(model.aliases["serving"])
    assert serving == (c2["done"]["validate"]["version"] if c2["outcome"] == "serving" else v1)
    assert client.get_model_version("flywheel-policy", serving).tags["checkpoint_sha256"] == final["checkpoint_sha256"]

    # the token: nowhere under the run (state, logs, MLflow's store and artifacts), nor in the server's log
    leaks = [str(p) for p in [*run_dir.rglob("*"), tmp_path / "server.log"]
             if p.is_file() and token.encode() in p.read_bytes()]
    assert not leaks, leaks
    exp = client.get_experiment_by_name(tiny_cfg.mlflow.experiment)
    for r in client.search_runs([exp.experiment_id]):
        assert not any(token in str(v) for v in [*r.data.params.values(), *r.data.tags.values()]), r.info.run_name
    for v in client.search_model_versions("name='flywheel-policy'"):
        assert not any(token in str(t) for t in v.tags.values())
