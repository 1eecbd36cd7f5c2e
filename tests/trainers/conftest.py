"""The trainer tests' dataset is `rl_dataset` (tests/conftest.py): real tiny-model episodes with
planted rewards; here, a copy of it to damage."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture
def dataset_copy(rl_dataset, tmp_path):
    """A copy of the planted dataset to damage."""
    dst = tmp_path / "ds"
    shutil.copytree(rl_dataset.path, dst)
    return dst
