"""Task success of a checkpoint *as served*: quantized in the serving format (as `loop serve`
would: loop.serving.resolve), run on the vLLM engine, on the task's eval split.

    loop eval CONFIG MODEL [key=value ...] [--quant auto|w4a16|w8a8|none] [--temperature 1.0 0]

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


def eval_success(llm, tokenizer, task, temperature: float) -> float:
    """Success on the task's eval split (`task.num_eval_problems`, `task.seed`) through `llm`."""
    from rollout.engine import vllm_generate
    from rollout.episode import run_episodes, success_rate
    from rollout.task import make_problems

    problems = make_problems("eval", task.num_eval_problems, task.seed)
    return success_rate(run_episodes(problems, tokenizer, vllm_generate(llm), temperature=temperature))


def evaluate_here(cfg, model: str, quant: str, temperatures: tuple[float, ...] = (1.0,),
                  logprobs: tuple[str, str, int] | None = None) -> dict:
    """In this process: {"fmt", "served_path", "T=<t>": success, "seconds", "num_problems", ...}.
    `logprobs` (sequences JSON, output .pt, k): also the engine's teacher-forced log-probs of the
    sequences at their scored positions (rollout.engine.prompt_logprobs), saved to the .pt file."""
    from transformers import AutoTokenizer

    from loop.serving import engine_for, resolve
    from rollout.engine import make_llm

    cfg = dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, quant=quant))
    served = resolve(cfg, model)
    t0 = time.perf_counter()
    llm = make_llm(served.path, engine_for(cfg, served), **({"max_logprobs": logprobs[2]} if logprobs else {}))
    out = {"model": str(model), "fmt": served.fmt, "served_path": served.path, "dtype": served.dtype,
           "num_problems": cfg.task.num_eval_problems, "kernel_build": served.caps.kernel_build}
    tokenizer = AutoTokenizer.from_pretrained(served.path)
    for t in temperatures:
        out[f"T={t}"] = eval_success(llm, tokenizer, cfg.task, t)
    if logprobs:
        _save_logprobs(llm, served.path, *logprobs)
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
                   temperatures: tuple[float, ...] = (1.0,), logprobs: tuple[str, str, int] | None = None) -> dict:
    """`evaluate_here` in a child process (its engine goes when it exits). The child runs vLLM's
    engine core and worker in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=0): an offline
    evaluation needs no separate processes, and the engine starts in ~7 s instead of ~25 s here."""
    cmd = [sys.executable, "-m", "loop.evaluate", config, str(model), *overrides, "--quant", quant,
           "--temperature", *map(str, temperatures), "--json"]
    if logprobs:
        cmd += ["--logprobs", logprobs[0], logprobs[1], "--logprobs-k", str(logprobs[2])]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"evaluation of {model} ({quant}) failed:\n{proc.stderr[-3000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"model"')]  # vLLM logs to stdout too
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    import argparse

    from loop.config import load_config
    from loop.configs import ConfigError

    p = argparse.ArgumentParser(prog="loop eval", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("model")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--quant", default="auto")
    p.add_argument("--temperature", type=float, nargs="+", default=[1.0])
    p.add_argument("--json", action="store_true", help="print only the result as one JSON line")
    p.add_argument("--logprobs", nargs=2, metavar=("SEQS_JSON", "OUT_PT"),
                   help="also save the engine's prompt log-probs of {ids, scored} sequences")
    p.add_argument("--logprobs-k", type=int, default=20)
    a = p.parse_intermixed_args(argv)
    try:
        cfg = load_config(a.config, a.overrides)
        result = evaluate_here(cfg, a.model, a.quant, tuple(a.temperature),
                               (*a.logprobs, a.logprobs_k) if a.logprobs else None)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if not a.json:
        print(f"{result['model']} served as {result['fmt']} ({result['kernel_build']}): " +
              ", ".join(f"success at {k} {v:.1%}" for k, v in result.items() if k.startswith("T=")) +
              f" on {result['num_problems']} eval problems")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
