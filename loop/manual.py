"""The gate and the registry by hand.

    loop validate CONFIG SERVING CANDIDATE [key=value ...] [--fp DIR] [--dataset DIR]
        the KL gate between any two checkpoints: CANDIDATE (as it would serve) against SERVING, on
        the held-out split of DATASET (default: the newest under <run_dir>/datasets); CANDIDATE's
        full-precision weights are --fp, else the parent its manifest names. Exit 0 pass, 1 fail.
    loop rollback CONFIG [key=value ...] [--endpoint URL]
        the registry's `previous` version back on the server (collect.endpoint, or --endpoint) and
        in the aliases; the admin token is in the env var serve.admin_token_env names (or serve.admin_token_file).
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path


def _parse(p: argparse.ArgumentParser, argv: list[str]):
    """(args, the LoopConfig of args.config + args.overrides), or (args, None) after a config error."""
    from loop.config import load_config
    from loop.configs import ConfigError

    a = p.parse_intermixed_args(argv)
    try:
        return a, load_config(a.config, a.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return a, None


def validate_main(argv: list[str]) -> int:
    import mlflow

    from loop.gate import fp_of, gate, gate_eval_seed, heldout, log_report
    from loop.tracking import start_run

    p = argparse.ArgumentParser(prog="loop validate", description="the KL gate between two checkpoints")
    p.add_argument("config")
    p.add_argument("serving")
    p.add_argument("candidate")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--fp", help="the candidate's full-precision weights (default: its manifest's parent)")
    p.add_argument("--dataset", help="an RL dataset folder (default: the newest under <run_dir>/datasets)")
    a, cfg = _parse(p, argv)
    if cfg is None:
        return 2
    dataset = a.dataset or max((str(d) for d in (Path(cfg.run_dir) / "datasets").glob("*") if d.is_dir()), default=None)
    if dataset is None:
        print(f"no dataset: pass --dataset DIR (none under {cfg.run_dir}/datasets)", file=sys.stderr)
        return 2
    run_dir = Path(cfg.run_dir)
    seqs = heldout(cfg, dataset)
    out = run_dir / "gates" / f"manual-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"
    with start_run(cfg, "validate (manual)", tags={"phase": "validate", "candidate": a.candidate,
                                                   "serving": a.serving}):
        g = gate(cfg, a.candidate, a.fp or fp_of(a.candidate), a.serving, seqs, run_dir, out,
                 eval_seed=gate_eval_seed(cfg, f"manual-{int(datetime.now(timezone.utc).timestamp())}"),
                 ope_seqs=heldout(cfg, dataset, cfg.validate.ope_sequences))
        log_report(g.report)
        mlflow.log_artifacts(str(out), artifact_path="gate")
    print(g.report.summary_line())
    print(f"report: {out / 'gate_report.json'}")
    return 0 if g.report.passed else 1


def rollback_main(argv: list[str]) -> int:
    from pipelines.promote import AdminClient, Registry, rollback

    p = argparse.ArgumentParser(prog="loop rollback", description="put the `previous` version back")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--endpoint", help="the server (default: collect.endpoint)")
    a, cfg = _parse(p, argv)
    if cfg is None:
        return 2
    url = a.endpoint or cfg.collect.endpoint
    if not url:
        print("no server to roll back: pass --endpoint URL or set collect.endpoint", file=sys.stderr)
        return 2
    registry = Registry(cfg.tracking_uri, cfg.promote.model_name)
    try:
        outcome = rollback(registry, AdminClient(url, cfg.serve.resolved_admin_token()), cfg.promote.swap_mode)
    except (ValueError, RuntimeError) as e:
        print(f"rollback failed: {e}", file=sys.stderr)
        return 1
    print(f"rolled back: {registry.name} v{outcome.version} serves again "
          f"(server weight version {outcome.swap.get('weight_version')})")
    return 0
