"""An RL dataset of real tiny-model episodes (the shared engine's `ds_episodes`, written as
traces and built by pipelines.traces_to_dataset) with planted rewards: within each group of G
samples, alternate episodes score 1 and 0 (feedback in "override" mode), so every group carries
signal whatever the tiny model's own success."""

from __future__ import annotations

import shutil

import pytest

from pipelines.traces_to_dataset import DatasetConfig, build_dataset
from rollout.traces import Feedback


@pytest.fixture(scope="session")
def rl_dataset(ds_episodes, ds_traces, ds_write, ds_tokenizer_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("rl-data")
    traces, feedback = [], []
    for i, (eid, ep) in enumerate(ds_episodes):
        tr = ds_traces(ep, f"rl-{i // 4}-{i % 4}")  # <run>-<problem>-<sample>: one round
        traces += tr
        feedback.append(Feedback(trace_id=tr[-1].trace_id, episode_id=tr[-1].episode_id, reward=float(i % 2),
                                 source="env:planted", created_at=tr[-1].created_at))
    ds_write(root / "data", traces, feedback)
    return build_dataset(DatasetConfig(trace_root=root / "data", out_dir=root / "ds", tokenizer=ds_tokenizer_path,
                                       heldout_fraction=0.0, feedback_mode="override"))


@pytest.fixture
def dataset_copy(rl_dataset, tmp_path):
    """A copy of the planted dataset to damage."""
    dst = tmp_path / "ds"
    shutil.copytree(rl_dataset.path, dst)
    return dst
