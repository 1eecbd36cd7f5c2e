"""`loop`: the Flywheel command line.

    loop run CONFIG [key=value ...]        bootstrap the base model if needed, then run the loop
    loop bootstrap CONFIG [key=value ...]  build (or reuse) the base model and measure it on vLLM
    loop ui CONFIG [--port P]              the MLflow UI on the run's tracking store (light: one worker)
    loop status CONFIG [key=value ...]     the serving version, the last cycles, where traces and MLflow are
    loop serve CONFIG [key=value ...]      serve the model (serve.model, else the base) over HTTP
    loop config CONFIG [key=value ...]     print the resolved config
    loop eval CONFIG MODEL [--quant FMT]   task success of MODEL as served (quantized) on vLLM
    loop validate CONFIG SERVING CANDIDATE the KL gate between two checkpoints (loop/manual.py)
    loop rollback CONFIG [--endpoint URL]  the registry's `previous` version back on the server

Overrides use Hydra's grammar: `loop run conf/agent_rl.yaml bootstrap.sft.lr=5e-4`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict

from loop.configs import ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loop", description="Flywheel: serve, trace, train, requantize, gate, swap.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("run", "run the loop"), ("bootstrap", "build the base model"),
                        ("config", "print the resolved config"), ("ui", "open the MLflow UI"),
                        ("status", "where the run stands: serving version, last cycles, stores"),
                        ("serve", "serve the model over the OpenAI API, traced"),
                        ("eval", "task success of a checkpoint as served (loop eval -h)"),
                        ("validate", "the KL gate between two checkpoints (loop validate -h)"),
                        ("rollback", "put the registry's previous version back (loop rollback -h)")):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("config", help="a YAML file under conf/")
        sp.add_argument("overrides", nargs="*", help="Hydra-style overrides: key.sub=value")
        if name == "serve":
            sp.add_argument("--replicas", type=int, default=None, help="N servers behind vllm-router (serve.replicas)")
        if name == "ui":
            sp.add_argument("--port", type=int, default=5000)
            sp.add_argument("--host", default="127.0.0.1")
    return p


def _replicas_flag(argv: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--replicas" and i + 1 < len(argv):
            out.append(f"serve.replicas={argv[i + 1]}")
            i += 2
            continue
        out.append(f"serve.replicas={a.split('=', 1)[1]}" if a.startswith("--replicas=") else a)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval"]:  # its own flags: loop/evaluate.py
        return eval_main(argv[1:])
    if argv[:1] in (["validate"], ["rollback"]):  # their own flags: loop/manual.py
        from loop.manual import rollback_main, validate_main

        return (validate_main if argv[0] == "validate" else rollback_main)(argv[1:])
    if argv[:1] == ["serve"]:  # `--replicas N` anywhere among the overrides: serve.replicas=N
        argv = _replicas_flag(argv)
    args = _parser().parse_args(argv)
    from loop.config import load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(json.dumps(asdict(cfg), indent=2))
        return 0
    if args.command == "ui":
        from loop.status import ui_command

        cmd, env = ui_command(cfg, args.port, args.host)
        print(f"MLflow UI on {cfg.tracking_uri}: http://{args.host}:{args.port}", flush=True)
        return subprocess.call(cmd, env=env)
    if args.command == "status":
        from loop.status import status_lines

        print("\n".join(status_lines(cfg)))
        return 0
    if args.command == "serve":
        from loop.serving import engine_for, resolve
        from rollout.server import serve
        from rollout.capabilities import detect
        from rollout.server.app import check_servable, check_speculation

        if cfg.serve.replica_urls:  # the front door alone: the replicas (held) load their model
            from rollout.server.fleet_serve import serve_fleet

            return serve_fleet(args.config, args.overrides, cfg.serve)
        model = cfg.serve.model
        if model is None:
            from loop.bootstrap import bootstrap

            model = bootstrap(cfg.bootstrap, cfg.task).path
        try:
            served = resolve(cfg, model)
            check_servable(served.path, engine_for(cfg, served))
            check_speculation(cfg.serve, detect())
            cfg.serve.resolved_api_key()
        except (ConfigError, ValueError) as e:
            print(f"config error: {args.config}: {e}", file=sys.stderr)
            return 2
        if cfg.serve.replicas > 1:  # the replicas load the folder resolved (and quantized) here, once
            from rollout.server.fleet_serve import serve_fleet

            return serve_fleet(args.config, [*args.overrides, f"serve.model={served.path}"], cfg.serve)
        serve(cfg.serve, engine_for(cfg, served), served.path)
        return 0
    from loop.run import bootstrap_phase, run

    if args.command == "bootstrap":
        bootstrap_phase(cfg)
        return 0
    return run(cfg)


def eval_main(argv: list[str]) -> int:
    """`loop eval` (also the gate's child process: loop.evaluate.served_success)."""
    from loop.config import load_config
    from loop.evaluate import evaluate_here

    p = argparse.ArgumentParser(prog="loop eval", description="task success of MODEL as served (quantized) on vLLM")
    p.add_argument("config")
    p.add_argument("model")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--quant", default="auto")
    p.add_argument("--temperature", type=float, nargs="+", default=[1.0])
    p.add_argument("--json", action="store_true", help="print only the result as one JSON line")
    p.add_argument("--logprobs", nargs=2, metavar=("SEQS_JSON", "OUT_PT"),
                   help="also save the engine's prompt log-probs of {ids, scored} sequences")
    p.add_argument("--logprobs-k", type=int, default=20)
    p.add_argument("--paired", help="a second model played on the same problems after the first (the gate's test)")
    p.add_argument("--eval-seed", help="which eval problems (default: task.seed)")
    p.add_argument("--no-play", action="store_true",
                   help="no eval problems: the engine's --logprobs only (the gate's engine stage for your agent)")
    a = p.parse_intermixed_args(argv)
    try:
        cfg = load_config(a.config, a.overrides)
        if cfg.task.agent and not a.no_play:  # your agent on your eval tasks, through a server of MODEL
            from loop.evaluate import agent_eval

            result = agent_eval(cfg, a.model)
            print(json.dumps(result) if a.json else f"{a.model} with {cfg.task.agent}: success {result['success']:.1%} on "
                  f"{result['num_problems']} eval tasks ({result['abandoned']} abandoned, {result['pending']} rewarded later)")
            return 0
        result = evaluate_here(cfg, a.model, a.quant, () if a.no_play else tuple(a.temperature),
                               (*a.logprobs, a.logprobs_k) if a.logprobs else None, a.paired, a.eval_seed)
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
