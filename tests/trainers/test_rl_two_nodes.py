"""Training on a real two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: a head and
a second node, each its own raylet with one CPU): with `placement: STRICT_SPREAD` the two workers run
one on each node and rank 0 writes the checkpoint once; the second node killed mid-step fails the
phase with a named error and leaves nothing behind; with a node back, the same job (what `loop run`
reruns on resume) trains to the end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_rl_ray import RUN, SPEC
from trainers.rl.config import RLConfig
from trainers.rl.launch import RayConfig, TrainingFailed, ensure_ray, run_training, shutdown_ray
from trainers.rl.train import TrainJob

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    shutdown_ray()  # this process joins the cluster as its driver, not a runtime of its own
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"fw_node_a": 1},
                                                      "object_store_memory": 80 << 20})
    c.add_node(num_cpus=1, resources={"fw_node_b": 1}, object_store_memory=80 << 20)
    c.wait_for_nodes()
    ensure_ray(RayConfig(address=c.address))
    yield c
    shutdown_ray()
    c.shutdown()


def nodes_alive() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def test_workers_spread_over_two_nodes_and_a_lost_node_fails_the_phase_by_name(cluster, tiny_base, rl_dataset,
                                                                              tmp_path):
    spread = RLConfig(num_workers=2, placement="STRICT_SPREAD", **{**RUN, "epochs": 10})
    long = RLConfig(num_workers=2, placement="STRICT_SPREAD", **{**RUN, "epochs": 100})  # 200 steps: ~a minute
    ckpt = run_training(TrainJob(tiny_base.path, rl_dataset.path, str(tmp_path / "ok"), spread, SPEC),
                        RayConfig(address=cluster.address))
    assert ckpt.world_size == 2 and len(set(ckpt.nodes)) == 2 and set(ckpt.nodes) == nodes_alive()
    assert ckpt.metrics["ranks_max_param_diff"] == 0.0
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".ray")) == ["ok"]  # written once

    second = next(n for n in cluster.worker_nodes)
    steps = []

    def kill_at_step_3(step, metrics):
        steps.append(step)
        if step == 3:
            cluster.remove_node(second, allow_graceful=False)  # its raylet SIGKILLed, the worker on it with it

    out = tmp_path / "lost"
    with pytest.raises(TrainingFailed, match="training on Ray failed: a worker died or its node left the cluster"):
        run_training(TrainJob(tiny_base.path, rl_dataset.path, str(out), long, SPEC),
                     RayConfig(address=cluster.address), report=kill_at_step_3)
    assert 3 in steps and max(steps) < 200, steps  # it was training, and it did not finish
    assert not out.exists() and not list(tmp_path.glob(".lost.tmp-*"))  # nothing half-written

    cluster.add_node(num_cpus=1, resources={"fw_node_b": 1}, object_store_memory=80 << 20)
    cluster.wait_for_nodes()
    again = run_training(TrainJob(tiny_base.path, rl_dataset.path, str(out), spread, SPEC),
                         RayConfig(address=cluster.address))
    assert again.metrics["steps"] == 20 and len(set(again.nodes)) == 2


def test_without_an_address_a_loop_starts_its_own_runtime_beside_a_running_cluster(cluster):
    """`ray.address: null` with a cluster up on the host (its address in /tmp/ray, where Ray's
    default for no address finds it and joins): another process starts a runtime of its own."""
    code = ("import ray; from trainers.rl.launch import RayConfig, ensure_ray, shutdown_ray; "
            "ensure_ray(RayConfig(num_cpus=1)); print(ray.get_runtime_context().gcs_address, len(ray.nodes())); "
            "shutdown_ray()")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    address, nodes = out.stdout.split()[-2:]
    assert address != cluster.address and nodes == "1", (address, cluster.address, nodes)
