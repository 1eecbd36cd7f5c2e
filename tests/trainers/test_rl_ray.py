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
# prefix_rows=1: every row's forward is the same on 1 or 2 ranks, so the weights match to float
# precision; with shared prompts a prompt's gradient is summed in another order on 2 ranks, and
# Adam turns a float-level difference in a near-zero gradient into a whole step (the last test)
RUN = dict(lr=1e-3, warmup_steps=0, lr_schedule="constant", minibatch_episodes=4, epochs=2, progress=False,
           threads_per_worker=1, prefix_rows=1)


def one_thread():
    """This process on one thread, as each worker is: the same kernels, comparable float sums."""
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1, "torch.set_num_threads was replaced (an in-process vLLM worker?)"


@pytest.fixture(scope="module")
def ray_runtime():
    import ray

    from trainers.rl.launch import ensure_ray, shutdown_ray

    ensure_ray(RayConfig(num_cpus=2))
    # Ray's own clients in this process find this runtime, not another `loop run`'s on the host
    assert os.environ["RAY_ADDRESS"] == ray.get_runtime_context().gcs_address
    yield
    shutdown_ray()
    assert "RAY_ADDRESS" not in os.environ  # a later local runtime is a new one


def test_two_ray_workers_equal_one_process(ray_runtime, tiny_base, rl_dataset, tmp_path):
    one_thread()
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


def test_two_ray_workers_sharing_prompts_take_the_same_steps(ray_runtime, tiny_base, rl_dataset, tmp_path):
    one_thread()
    run = {**RUN, "prefix_rows": 4}  # the planted groups have 4 rows: a rank holds half a piece
    two = run_training(TrainJob(tiny_base.path, rl_dataset.path, str(tmp_path / "two"),
                                RLConfig(num_workers=2, **run), SPEC), RayConfig())
    one = run_training(TrainJob(tiny_base.path, rl_dataset.path, str(tmp_path / "one"),
                                RLConfig(num_workers=0, **run), SPEC), RayConfig())
    assert two.metrics["ranks_max_param_diff"] == 0.0 and two.metrics["steps"] == one.metrics["steps"] == 4
    assert [h["tokens"] for h in two.history] == [h["tokens"] for h in one.history]
    first2, first1 = two.history[0], one.history[0]  # the same weights in: the same step to float precision
    assert first2["loss"] == pytest.approx(first1["loss"], rel=1e-5)
    assert first2["grad_norm"] == pytest.approx(first1["grad_norm"], rel=1e-5)
    for h2, h1 in zip(two.history[1:], one.history[1:]):  # after Adam's amplification of float noise
        assert h2["loss"] == pytest.approx(h1["loss"], rel=1e-2, abs=1e-3)
    a, b = (load_file(str(Path(m.path) / "model.safetensors")) for m in (two, one))
    base = load_file(str(Path(tiny_base.path) / "model.safetensors"))
    for k in a:
        moved = (b[k] - base[k]).abs()
        assert (a[k] - b[k]).abs().mean() <= 0.05 * moved.mean(), k  # the same steps, not merely similar
