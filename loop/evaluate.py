"""Task success of a checkpoint *as served*: quantized in the serving format (as `loop serve`
would: loop.serving.resolve), run on the vLLM engine, on the task's eval split.

    loop eval CONFIG MODEL [key=value ...] [--quant auto|w4a16|w8a8|none] [--temperature 1.0 0]
    (its command line: loop/cli.py `eval_main`, which loads the config; nothing here does)

Each evaluation runs its engine in a child process (`served_success`), so one process can compare
many checkpoints and formats without engines piling up in it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time


def eval_outcomes(llm, tokenizer, task, temperature: float, seed: int | str | None = None) -> list[float]:
    """Each eval problem's reward through `llm` (`task.num_eval_problems` of the eval split drawn
    with `seed`, default `task.seed`), in problem order."""
    from rollout.engine import vllm_generate
    from rollout.episode import run_episodes

    world = task.load()
    problems = world.problems("eval", task.num_eval_problems, task.seed if seed is None else seed)
    return [float(e.reward) for e in run_episodes(problems, tokenizer, vllm_generate(llm), task=world,
                                                  temperature=temperature)]


def eval_success(llm, tokenizer, task, temperature: float, seed: int | str | None = None) -> float:
    """Success on the task's eval split (`task.num_eval_problems`, `seed` else `task.seed`) through `llm`."""
    outcomes = eval_outcomes(llm, tokenizer, task, temperature, seed)
    return sum(outcomes) / max(1, len(outcomes))


def evaluate_here(cfg, model: str, quant: str, temperatures: tuple[float, ...] = (1.0,),
                  logprobs: tuple[str, str, int] | None = None, paired: str | None = None,
                  eval_seed: str | None = None) -> dict:
    """In this process: {"fmt", "served_path", "T=<t>": success, "outcomes": {"T=<t>": [reward per
    problem]}, "seconds", "num_problems", ...}. `logprobs` (sequences JSON, output .pt, k): also the
    engine's teacher-forced log-probs of the sequences at their scored positions
    (rollout.engine.prompt_logprobs), saved to the .pt file. `paired`: a second model (the serving
    version) played on the very same problems at the same temperatures after the first, in this
    process, under "paired" (the gate's paired test). `eval_seed`: which eval problems (default
    `task.seed`; the gate draws fresh ones each cycle)."""
    import gc

    from transformers import AutoTokenizer

    from loop.serving import engine_for, resolve
    from rollout.engine import make_llm

    cfg = dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, quant=quant))
    t0 = time.perf_counter()

    def play(path: str, extra: dict) -> tuple[dict, object]:
        served = resolve(cfg, path)
        llm = make_llm(served.path, engine_for(cfg, served), **extra)
        tokenizer = AutoTokenizer.from_pretrained(served.path)
        res = {"model": str(path), "fmt": served.fmt, "served_path": served.path, "dtype": served.dtype,
               "kernel_build": served.caps.kernel_build, "outcomes": {}}
        for t in temperatures:
            res["outcomes"][f"T={t}"] = eval_outcomes(llm, tokenizer, cfg.task, t, eval_seed)
            res[f"T={t}"] = sum(res["outcomes"][f"T={t}"]) / cfg.task.num_eval_problems
        return res, llm

    out, llm = play(model, {"max_logprobs": logprobs[2]} if logprobs else {})
    out |= {"num_problems": cfg.task.num_eval_problems, "eval_seed": eval_seed}
    if logprobs:
        _save_logprobs(llm, out["served_path"], *logprobs)
    if paired:
        del llm  # one engine at a time in this process
        gc.collect()
        out["paired"], llm = play(paired, {})
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _save_logprobs(llm, path: str, seqs_json: str, out_pt: str, k: int) -> None:
    import torch
    from transformers import AutoConfig

    from rollout.engine import prompt_logprobs

    seqs = json.loads(open(seqs_json).read())
    vocab = AutoConfig.from_pretrained(path).vocab_size
    lp = prompt_logprobs(llm, seqs["ids"], seqs["scored"], k, vocab)
    torch.save({"logprobs": lp, "k": k, "vocab_size": vocab}, out_pt)


def served_success(config: str, model: str, quant: str, overrides: list[str] = (),
                   temperatures: tuple[float, ...] = (1.0,), logprobs: tuple[str, str, int] | None = None,
                   paired: str | None = None, eval_seed: str | None = None) -> dict:
    """`evaluate_here` in a child process (its engine goes when it exits). The child runs vLLM's
    engine core and worker in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=0): an offline
    evaluation needs no separate processes, and the engine starts in ~7 s instead of ~25 s here."""
    cmd = [sys.executable, "-m", "loop.cli", "eval", config, str(model), *overrides, "--quant", quant, "--json"]
    cmd += ["--temperature", *map(str, temperatures)] if temperatures else ["--no-play"]
    if logprobs:
        cmd += ["--logprobs", logprobs[0], logprobs[1], "--logprobs-k", str(logprobs[2])]
    if paired:
        cmd += ["--paired", str(paired)]
    if eval_seed is not None:
        cmd += ["--eval-seed", str(eval_seed)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"evaluation of {model} ({quant}) failed:\n{proc.stderr[-3000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"model"')]  # vLLM logs to stdout too
    return json.loads(lines[-1])


def agent_eval(cfg, model: str) -> dict:
    """Your agent (`task.agent`) on `task.source`'s eval split (its first `task.num_eval_problems`
    tasks), each played once, through `loop serve` of `model` in a child process (its traces go to
    a scratch folder: evaluation traffic is not training data). Success is the mean reward, an
    abandoned episode counting 0; an episode whose reward comes later is left out and counted."""
    import asyncio
    import tempfile
    from pathlib import Path

    from loop.configs import ConfigError, to_yaml
    from rollout.agents import AgentRunConfig, load_agent, run_agent
    from rollout.server.process import ServerProcess
    from rollout.task_source import load_tasks

    tasks = load_tasks(cfg.task.source, "eval")[:cfg.task.num_eval_problems]
    if not tasks:
        raise ConfigError(f"task.source {cfg.task.source}: the eval split holds no task")
    r = cfg.collect.rollout
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "serve.yaml").write_text(to_yaml(cfg))
        with ServerProcess(Path(d) / "serve.yaml", model, Path(d) / "data", Path(d) / "serve.log") as srv:
            run = AgentRunConfig(base_url=srv.url, group_size=1, concurrency=r.concurrency,
                                 episode_timeout_s=r.episode_timeout_s, request_timeout_s=r.request_timeout_s,
                                 api_key=cfg.serve.resolved_api_key() or "unused")
            episodes = asyncio.run(run_agent(load_agent(cfg.task.agent), tasks, run))
    by_task = [None if e.status == "pending" else e.reward if e.status == "ok" else 0.0 for e in episodes]
    scored = [x for x in by_task if x is not None]
    return {"model": str(model), "agent": cfg.task.agent, "num_problems": len(tasks), "success": sum(scored) / max(1, len(scored)),
            "outcomes": scored, "by_task": by_task, "abandoned": sum(e.status == "abandoned" for e in episodes),
            "pending": sum(e.status == "pending" for e in episodes), "seconds": round(time.perf_counter() - t0, 1)}


def agent_paired(cfg, candidate: str, serving: str) -> tuple[list[float], list[float], float] | None:
    """Your agent on `task.source`'s eval split through a server of the candidate, then of the
    serving version: the per-task rewards of the tasks both scored (a reward that comes later leaves
    its task out), and the seconds. None when the source has no eval split."""
    from rollout.task_source import load_tasks

    if not load_tasks(cfg.task.source, "eval"):
        return None
    t0 = time.perf_counter()
    c, s = agent_eval(cfg, candidate)["by_task"], agent_eval(cfg, serving)["by_task"]
    both = [(a, b) for a, b in zip(c, s) if a is not None and b is not None]
    return [a for a, _ in both], [b for _, b in both], time.perf_counter() - t0

