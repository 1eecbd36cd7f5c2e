"""Fixtures for the rollout server: a real `loop serve` subprocess on the tiny model (one per
session) and an openai client on it. Engines take 20-60 s to start here: `srv_main` is shared
by every test that can share it.
"""

from __future__ import annotations

import pytest
from srv_util import ServerProc


@pytest.fixture(scope="session")
def srv_main(tiny_base, tmp_path_factory):
    root = tmp_path_factory.mktemp("srv_main")
    server = ServerProc(tiny_base.path, root / "data", root / "server.log", ["serve.max_queue=12"])
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def srv_client(srv_main):
    import openai

    return openai.OpenAI(base_url=srv_main.url + "/v1", api_key="unused", max_retries=0, timeout=120)
