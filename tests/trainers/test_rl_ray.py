"""The training job on a real local Ray runtime (Ray Train TorchTrainer, gloo): 2 workers keep
identical parameters and take the step 1 process takes on the same global batch; metrics stream
back to the caller; a bad dataset fails in the caller before any worker starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kernels import QuantSpec
from trainers.rl.config import RLConfig
from trainers.rl.data import DatasetError
from trainers.rl.launch import RayConfig, run_training
from trainers.rl.train import TrainJob

SPEC = QuantSpec.w4a16(32, scale_dtype="bfloat16").to_dict()
RUN = dict(lr=1e-3, warmup_steps=0, lr_schedule="constant", minibatch_episodes=4, epochs=2, progress=False,
           threads_per_worker=1)


@pytest.fixture(scope="module")
def ray_runtime():
    import ray

    from trainers.rl.launch import ensure_ray

    ensure_ray(RayConfig(num_cpus=2))
    yield
    ray.shutdown()


def test_two_ray_workers_equal_one_process(ray_runtime, tiny_base, rl_dataset, tmp_path):
    torch.set_num_threads(1)  # the same kernels as the workers': comparable float sums
    reports = []
    rel = os.path.relpath  # paths relative to this process's directory (the loop's default run_dir is)
    two = run_training(TrainJob(rel(tiny_base.path), rel(rl_dataset.path), rel(tmp_path / "two"),
                                RLConfig(num_workers=2, **RUN), SPEC), RayConfig(), report=lambda s, m: reports.append(s))
    one = run_training(TrainJob(tiny_base.path, rl_dataset.path, str(tmp_path / "one"), RLConfig(num_workers=0, **RUN),
                                SPEC), RayConfig())
    assert two.world_size == 2 and two.metrics["ranks_max_param_diff"] == 0.0
    assert reports == list(range(1, 5)) and two.metrics["steps"] == one.metrics["steps"] == 4
    a, b = (load_file(str(Path(m.path) / "model.safetensors")) for m in (two, one))
    base = load_file(str(Path(tiny_base.path) / "model.safetensors"))
    for k in a:
        moved = (b[k] - base[k]).abs().max()
        assert moved > 0, k
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5 + 1e-3 * float(moved), msg=k)
    for h2, h1 in zip(two.history, one.history):
        assert h2["tokens"] == h1["tokens"]
        assert h2["loss"] == pytest.approx(h1["loss"], rel=1e-4, abs=1e-6)


def test_a_bad_dataset_fails_before_workers_start(ray_runtime, tiny_base, dataset_copy, tmp_path):
    (dataset_copy / "flywheel_manifest.json").unlink()
    with pytest.raises(DatasetError, match="not an RL dataset"):
        run_training(TrainJob(tiny_base.path, str(dataset_copy), str(tmp_path / "x"), RLConfig(num_workers=2, **RUN),
                              SPEC), RayConfig())
