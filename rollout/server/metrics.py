"""Flywheel's Prometheus metrics, served on `/metrics` after vLLM's own.

Ours live in a separate registry (vLLM may use a multiprocess registry), rendered beside vLLM's:
weight version, swaps and their pause, per-request prefix-cache hits and speculative counts
(from the same records the traces are built from), admission, and the trace writer's counters
(`traces_written`, `trace_write_seconds`, ... from `rollout.traces.register_metrics`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rollout.server.engine import GenRecord


class FlywheelMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.serving = Gauge("flywheel_serving_info", "What this server runs: 1 for its device, vLLM kernel "
                             "build, quant format and dtype.", ["device", "kernel_build", "quant_format", "dtype"],
                             registry=r)
        self.weight_version = Gauge("flywheel_weight_version", "Weight version now serving.", registry=r)
        self.swaps = Counter("flywheel_weight_swaps", "Hot-swap attempts by outcome.", ["outcome"], registry=r)
        self.swap_pause = Histogram("flywheel_weight_swap_pause_seconds", "Admission pause of a hot-swap.",
                                    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        self.requests = Counter("flywheel_engine_requests", "Engine requests by status.", ["status"], registry=r)
        self.prompt_tokens = Counter("flywheel_prompt_tokens", "Prompt tokens of engine requests.", registry=r)
        self.cached_tokens = Counter("flywheel_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
                                     registry=r)
        self.hit_rate = Gauge("flywheel_prefix_cache_hit_rate", "Cached / prompt tokens since start.", registry=r)
        self.hit_rate.set_function(self._hit_rate)
        # per weight version: a draft is swapped with its target, so this is the live acceptance of each pair
        self.spec_draft = Counter("flywheel_spec_draft_tokens", "Speculative draft tokens proposed.",
                                  ["weight_version"], registry=r)
        self.spec_accepted = Counter("flywheel_spec_accepted_tokens", "Speculative draft tokens accepted.",
                                     ["weight_version"], registry=r)
        self.rejected = Counter("flywheel_requests_rejected", "Requests refused at the queue limit (429).", registry=r)
        self.in_flight = Gauge("flywheel_requests_in_flight", "Engine requests admitted and not finished.", registry=r)
        self._prompt, self._cached = 0, 0

    def _hit_rate(self) -> float:
        return self._cached / self._prompt if self._prompt else 0.0

    def observe_record(self, rec: GenRecord) -> None:
        self.requests.labels(rec.status).inc()
        n = len(rec.prompt_token_ids)
        self._prompt += n
        self._cached += rec.num_cached_tokens
        self.prompt_tokens.inc(n)
        self.cached_tokens.inc(rec.num_cached_tokens)
        if rec.spec_draft_tokens:
            self.spec_draft.labels(str(rec.weight_version)).inc(rec.spec_draft_tokens)
            self.spec_accepted.labels(str(rec.weight_version)).inc(rec.spec_accepted_tokens)

    def render(self) -> bytes:
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        return generate_latest(get_prometheus_registry()) + generate_latest(self.registry)
