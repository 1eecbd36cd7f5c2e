"""Session fixtures shared by the suite: the tiny base model (built once by the real bootstrap)
and one offline vLLM engine on it. Engines take ~20-60 s to start here: share them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_cfg():
    from loop.config import load_config

    # cached under the repo's .cache/ so local reruns reuse the model; CI builds it once
    return load_config(REPO / "conf" / "tiny.yaml", [f"bootstrap.cache_dir={REPO / '.cache' / 'flywheel-test'}"])


@pytest.fixture(scope="session")
def tiny_base(tiny_cfg):
    from loop.bootstrap import bootstrap

    return bootstrap(tiny_cfg.bootstrap, tiny_cfg.task)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_base):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_base.path)


@pytest.fixture(scope="session")
def tiny_llm(tiny_base, tiny_cfg):
    from rollout.engine import make_llm

    llm = make_llm(tiny_base.path, tiny_cfg.engine)
    yield llm
    del llm
