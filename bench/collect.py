"""Collection throughput through the endpoint vs the bare engine, on the same episodes.

1. `loop serve` (the real server: tracing, commit-mode trace durability, feedback) in a
   subprocess; the collector plays `--problems` x `--group` calculator episodes over HTTP
   (token-in/token-out, `--concurrency` episodes in flight). Episodes/s, and the traces written.
2. Server stopped, then the bare offline engine (same EngineConfig) plays the same problems with
   `run_episodes` (each turn one batched `generate` call across all live episodes: the engine's
   best case). Episodes/s.
With `--draft`: (1b) a draft distilled (`speculator` config) on the traces phase (1) just wrote,
then the same server with it (vLLM's draft-model speculation at the rollouts' T=1; exact where
`Capabilities.speculates_exactly(1)`) plays the same episodes: episodes/s with vs without the
draft, side by side, and its live acceptance.
The ratio (1)/(2) is what serving, HTTP and tracing cost the collection (target >= 0.8). One
engine runs at a time: with the offline engine up in this process during the HTTP phase,
collection ran ~35% slower (measured), so the phases are sequential. Both phases run with the
engine's CPU placement (`engine.cpu_front_end`): with "reserved" this process runs on the
front-end cores in both, as the client in (1) and as the offline engine's front end in (2).
Each phase times `--rounds` rounds after a warm-up and compares the medians: on 2 shared cores
single rounds against one server spread 41-76 episodes/s (measured; a round now and then stalls
for seconds on this VM, in every placement).

    python bench/collect.py [--problems 64] [--group 8] [--concurrency 64] [--rounds 5] [--draft]
                            [--config conf/tiny.yaml] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# `python bench/collect.py` puts bench/ first on sys.path, where bench/kernels.py would shadow the
# `kernels` package the server imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per phase; the median is compared")
    ap.add_argument("--config", type=Path, default=REPO / "conf" / "tiny.yaml")
    ap.add_argument("--cache-dir", default=str(REPO / ".cache" / "flywheel-test"))
    ap.add_argument("--draft", action="store_true", help="also collect through the server with a draft distilled "
                                                         "on phase 1's traffic")
    ap.add_argument("overrides", nargs="*", help="config overrides for both sides, e.g. "
                                                 "serve.trace_durability=interval")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from loop.bootstrap import bootstrap
    from loop.config import load_config
    from rollout import cpu_placement
    from rollout.collector import CollectorConfig, collect_sync
    from rollout.engine import make_llm, vllm_generate
    from rollout.episode import run_episodes
    from rollout.server.process import ServerProcess
    from rollout.tasks.calculator import TASK, make_problems
    from rollout.traces import read_traces

    cfg = load_config(args.config, [f"bootstrap.cache_dir={args.cache_dir}", *args.overrides])
    base = bootstrap(cfg.bootstrap, cfg.task)
    tok = AutoTokenizer.from_pretrained(base.path)
    problems = make_problems("train", args.problems, seed=123)
    work = Path(tempfile.mkdtemp(prefix="fw-collect-"))
    n = args.problems * args.group
    def through_server(data: Path, overrides: list[str], label: str):
        with ServerProcess(args.config, base.path, data, work / f"server-{label}.log", overrides) as srv:
            warm = CollectorConfig(base_url=srv.url, group_size=1, progress=False, max_tokens=args.max_tokens)
            collect_sync(problems[:8], tok, warm, TASK)
            # the client runs where the server's front end does (with cpu_front_end=reserved)
            reserved = cfg.engine.reserves_front_end()
            with cpu_placement.beside_front_end(srv.proc.pid) if reserved else nullcontext() as cpus:
                print(f"[{label}] client on CPUs {cpus or 'any'}")
                rounds = [collect_sync(problems, tok, CollectorConfig(  # a fresh run_id (episode ids) per round
                    base_url=srv.url, group_size=args.group, concurrency=args.concurrency, max_tokens=args.max_tokens,
                    progress=False), TASK) for _ in range(args.rounds)]
            results, stats = sorted(rounds, key=lambda r: r[1].episodes_per_s)[len(rounds) // 2]
            srv.flush()
        traces = read_traces(data, columns=["episode_id"]).num_rows
        ok = [r for r in results if r.status == "ok"]
        print(f"[{label}] rounds: " + ", ".join(f"{s.episodes_per_s:.1f}" for _, s in rounds) + " episodes/s")
        print(f"[{label}] median round: {n} episodes ({len(ok)} ok, {stats.retries} retries, {stats.requests} "
              f"requests) in {stats.seconds:.2f} s: {stats.episodes_per_s:.1f} episodes/s, "
              f"{stats.tokens_sampled / stats.seconds:.0f} sampled tokens/s; {traces} trace rows in all; "
              f"success {sum(r.reward for r in ok) / max(1, len(ok)):.2f}")
        return stats

    try:
        stats = through_server(work / "data", args.overrides, "collect")
        if args.draft:
            draft_phase(cfg, base.path, work, stats, through_server, args.overrides)

        llm = make_llm(str(base.path), cfg.engine)
        gen = vllm_generate(llm)
        if cfg.engine.reserves_front_end():  # the offline engine's front end is this process: where the client ran
            print(f"[engine]  this process on CPUs {cpu_placement.pin_front_end(os.getpid())}")
        run_episodes(problems[:8], tok, gen, task=TASK, temperature=1.0, max_tokens=args.max_tokens)  # warm-up
        batch = [p for p in problems for _ in range(args.group)]
        bare = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            eps = run_episodes(batch, tok, gen, task=TASK, temperature=1.0, max_tokens=args.max_tokens)
            bare.append((time.perf_counter() - t, eps))
        print("[engine]  rounds: " + ", ".join(f"{n / dt:.1f}" for dt, _ in bare) + " episodes/s")
        dt, eps = sorted(bare, key=lambda r: r[0])[len(bare) // 2]
        toks = sum(len(turn.completion.token_ids) for e in eps for turn in e.turns)
        print(f"[engine]  median round: {n} episodes in {dt:.2f} s: {n / dt:.1f} episodes/s, {toks / dt:.0f} sampled tokens/s; "
              f"success {sum(e.reward for e in eps) / n:.2f}")
        print(f"[ratio]   collection / bare engine = {stats.episodes_per_s / (n / dt):.2f} (episodes/s), "
              f"{(stats.tokens_sampled / stats.seconds) / (toks / dt):.2f} (sampled tokens/s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def draft_phase(cfg, target: str, work: Path, plain, through_server, overrides: list[str]) -> None:
    """(1b): a draft distilled on phase 1's traffic; the same episodes through a server speculating with it."""
    from pipelines.speculator import distill
    from rollout.capabilities import detect
    from rollout.traces import read_traces

    t0 = time.perf_counter()
    m = distill(target, work / "data", work / "draft", cfg.speculator, progress=False)
    print(f"[draft] distilled in {time.perf_counter() - t0:.0f} s on {m.traces['requests']} requests: offline "
          f"acceptance {m.offline['rate']:.3f} at T={cfg.speculator.temperature:g} "
          f"(exact speculative sampling at T=1 here: {detect().speculates_exactly(1.0)})")
    k = cfg.speculator.num_speculative_tokens
    spec = through_server(work / "data-draft", [*overrides, "serve.speculative.method=draft",
                                                 f"serve.speculative.draft_model={m.path}",
                                                 f"serve.speculative.num_speculative_tokens={k}"], "draft")
    t = read_traces(work / "data-draft", columns=["spec_draft_tokens", "spec_accepted_tokens"])
    drafted, accepted = sum(t["spec_draft_tokens"].to_pylist()), sum(t["spec_accepted_tokens"].to_pylist())
    print(f"[ratio]   with / without the draft = {spec.episodes_per_s / plain.episodes_per_s:.2f} (episodes/s), "
          f"{(spec.tokens_sampled / spec.seconds) / (plain.tokens_sampled / plain.seconds):.2f} (sampled tokens/s); "
          f"live acceptance {accepted / max(drafted, 1):.3f} vs offline {m.offline['rate']:.3f}")


if __name__ == "__main__":
    main()
