"""`loop serve` for a fleet: `serve.replicas` > 1 starts N replicas behind the front door on this
machine; `serve.replica_urls` runs the front door alone over replicas started elsewhere
(rollout/server/fleet.py)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from rollout.server.fleet import Fleet


def serve_fleet(config: str | Path, overrides: list[str], serve_cfg) -> int:
    """`loop serve` with `serve.replicas` > 1: the replicas and the router on serve.host:port, until
    SIGINT/SIGTERM; with `serve.replica_urls`, the front door alone over replicas started elsewhere
    (held: `serve.start_held=true`). The fleet's admin API (rollout/server/fleet_admin.py) on
    serve.port and each replica's take the token the config resolves (without one, a fresh token
    printed nowhere: no admin API for you). A local replica that dies is restarted (held, then
    released on its group's weights)."""
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(1))
    log_dir = Path(serve_cfg.trace_root).parent / "fleet-logs"
    token = serve_cfg.resolved_admin_token()
    if serve_cfg.replica_urls and not token:
        raise ValueError(f"serve.replica_urls: the front door needs the replicas' admin token in "
                         f"${serve_cfg.admin_token_env} (serve.admin_token_env) or serve.admin_token_file")
    fleet = Fleet(config, serve_cfg.model, serve_cfg.trace_root, log_dir, serve_cfg.replicas,
                  overrides=[o for o in overrides if not o.startswith(("serve.replicas=", "serve.port=", "serve.host="))],
                  admin_token=token, host=serve_cfg.host, port=serve_cfg.port, replica_urls=serve_cfg.replica_urls,
                  episode_idle_s=serve_cfg.episode_idle_s, policy=serve_cfg.router_policy)
    with fleet:
        print(f"serving {len(fleet.servers)} replicas behind vllm-router on {fleet.url} "
              f"(replicas: {', '.join(s.url for s in fleet.servers)}; logs {log_dir})", flush=True)
        while not stop:
            for i, s in enumerate(fleet.servers):
                if not s.alive():
                    print(f"replica r{i} ({s.url}) exited with {s.proc.returncode}; the router routes around it "
                          f"while it restarts (log {s.log_path})", flush=True)
                    fleet.restart(i)
            if fleet.router.proc.poll() is not None:
                print(f"vllm-router exited with {fleet.router.proc.returncode} (log {fleet.router.log_path})", flush=True)
                return 1
            time.sleep(1)
    return 0
