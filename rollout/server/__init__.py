"""The rollout server: vLLM's OpenAI server in-process, traced, hot-swappable.

    from rollout.server import ServeConfig, SpeculativeConfig, serve
    serve(ServeConfig(model=path), EngineConfig(), path)   # or: loop serve conf/serve_tiny.yaml
"""

from rollout.server.config import ServeConfig, SpeculativeConfig, vllm_cli_args


def serve(cfg, engine_cfg, model):
    from rollout.server.app import serve as _serve

    return _serve(cfg, engine_cfg, model)


__all__ = ["ServeConfig", "SpeculativeConfig", "serve", "vllm_cli_args"]
