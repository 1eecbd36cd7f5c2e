"""Promote: a gated checkpoint becomes a version in the MLflow Model Registry and the server's
weights, or is recorded as rejected; and rollback, which puts the `previous` version back.

    register (alias `candidate`) ─▶ gate failed: alias `rejected`, tags say why; serving untouched
                                 ─▶ gate passed: hot-swap through the admin API ─▶ canary: the
                                    server's log-probs on held-out tokens reproduce the gate's ─▶
                                    aliases serving (new) / previous (old)
                                    canary failed: swap back, tag rolled_back

A promotion is written down before it happens and carries its precondition: the caller records
the intent (from sha -> to sha, the aliases as they were) in its state first; the swap sends the
gated sha and the sha it replaces (the server answers 409 on either mismatch); aliases move by
compare-and-set against the values the intent saw. A rerun after a kill reconciles the intent
with `/admin/status` instead of guessing: the candidate already serving is not swapped twice, and
a failing canary restores the intent's `from`, never what the server happens to serve.

Registry versions carry tags: weight version on the server, parent, dataset, quant format and
layer plan, KL summary, eval success, stack fingerprint, status. The version's source is the
checkpoint folder itself (a local registry; a remote one would log the folder as an artifact).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pipelines.failpoints import failpoint

ALIASES = ("serving", "previous", "candidate", "rejected")


@dataclass
class PromoteConfig:
    model_name: str = "flywheel-policy"  # the registered model
    canary_sequences: int = 4  # held-out episodes the server must reproduce after the swap
    canary_tolerance: float = 0.02  # mean |Δ logprob| of the server against the gate's engine (same kernels)
    swap_mode: str = "drain"  # the admin API's mode: "drain" | "keep"
    # Into a fleet (collect.endpoint = a fleet's front door, rollout/server/fleet_admin.py): the
    # candidate first serves `canary_fraction` of new episodes on its own replicas; with
    # `canary_seconds` > 0 it is judged on that much live traffic (episode reward and token logprob
    # against stable's, 95% intervals, these margins) and promoted fleet-wide only if not worse,
    # else rolled back. 0: no live judgment (a fleet no one else sends traffic to during the
    # promotion has nothing to judge it on).
    canary_fraction: float = 0.5
    canary_seconds: float = 0.0
    canary_margin: float = 0.05
    canary_logprob_margin: float = 0.5

    def __post_init__(self):
        if self.swap_mode not in ("drain", "keep"):
            raise ValueError(f"swap_mode must be 'drain' or 'keep', got {self.swap_mode!r}")
        if not 0 < self.canary_fraction < 1:
            raise ValueError(f"canary_fraction must be in (0, 1), got {self.canary_fraction}")
        if not self.canary_seconds >= 0 or not self.canary_margin >= 0 or not self.canary_logprob_margin >= 0:
            raise ValueError("canary_seconds, canary_margin and canary_logprob_margin must be >= 0")

    def fleet_canary(self) -> dict:
        """The `canary` of a fleet's /admin/weights."""
        return {"fraction": self.canary_fraction, "seconds": self.canary_seconds, "margin": self.canary_margin,
                "logprob_margin": self.canary_logprob_margin}
        if not self.canary_tolerance > 0 or self.canary_sequences < 1:
            raise ValueError("canary_tolerance must be > 0 and canary_sequences >= 1")


class AdminClient:
    """The server's admin API and its teacher-forced log-probs (vLLM's prompt_logprobs)."""

    def __init__(self, url: str, token: str | None, model: str = "flywheel"):
        self.url, self.model = url.rstrip("/"), model
        self.headers = {"authorization": f"Bearer {token}"} if token else {}

    def status(self) -> dict:
        r = httpx.get(self.url + "/admin/status", headers=self.headers, timeout=30)
        r.raise_for_status()
        return r.json()

    def swap(self, path: str, mode: str = "drain", draft_path: str | None = None, sha: str | None = None,
             expected_current_sha: str | None = None, canary: dict | None = None) -> tuple[int, dict]:
        """Swap the target (and the draft with it, when given) in one pause; `sha`: the weights
        expected in `path`, `expected_current_sha`: those expected to serve now (else 409);
        `canary`: a fleet's rollout (PromoteConfig.fleet_canary; a lone server has none)."""
        body = {"path": path, "mode": mode} | ({"draft_path": draft_path} if draft_path else {})
        body |= {"canary": canary} if canary else {}
        body |= {k: v for k, v in (("checkpoint_sha256", sha), ("expected_current_sha", expected_current_sha)) if v}
        r = httpx.post(self.url + "/admin/weights", headers=self.headers, json=body, timeout=600)
        return r.status_code, r.json()

    def sampled_logprobs(self, ids: list[int], scored: list[int]) -> list[float]:
        """The server's log-prob of token t+1 at each scored position t of `ids`."""
        r = httpx.post(self.url + "/v1/completions", timeout=120, json={
            "model": self.model, "prompt": list(ids), "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})
        r.raise_for_status()
        entries = r.json()["choices"][0]["prompt_logprobs"]
        return [entries[t + 1][str(ids[t + 1])]["logprob"] for t in scored]


@dataclass
class Outcome:
    status: str  # "serving" | "rejected" | "rolled_back" | "swap_refused" | "no_op"
    version: str
    reason: str = ""
    swap: dict = field(default_factory=dict)
    canary: dict = field(default_factory=dict)
    seconds: float = 0.0


class Registry:
    """The registered model's versions and aliases (an MLflow tracking URI holds the registry)."""

    def __init__(self, tracking_uri: str, name: str):
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        self.client, self.name = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri), name
        try:
            self.client.get_registered_model(name)
        except MlflowException:  # RESOURCE_DOES_NOT_EXIST
            self.client.create_registered_model(name, description="Flywheel policy versions, as served "
                                                "(quantized); aliases serving / previous / candidate / rejected")

    def register(self, path: str, tags: dict, run_id: str | None = None):
        """A new version of the checkpoint folder `path` (its weights stay where they are: tag
        `path`). A local store takes the folder as the version's source; a tracking server accepts
        only sources inside a run's artifacts, so there the source is `runs:/<run_id>/served/<name>`,
        where the folder's small files (config, manifests: not the weights) are logged."""
        tags = {**{k: _tag(v) for k, v in tags.items()}, "path": str(path)}
        source = str(path)
        if self.remote:
            if run_id is None:
                raise ValueError(f"registering {path} on the tracking server {self.client.tracking_uri} needs a run")
            source = f"runs:/{run_id}/served/{Path(path).name}"
            for f in sorted(Path(path).glob("*.json")):
                self.client.log_artifact(run_id, str(f), f"served/{Path(path).name}")
        return self.client.create_model_version(self.name, source=source, run_id=run_id, tags=tags)

    @property
    def remote(self) -> bool:
        return str(self.client.tracking_uri).startswith(("http://", "https://"))

    @staticmethod
    def path_of(version) -> str:
        """The checkpoint folder a version names (versions registered before the tag: their source)."""
        return version.tags.get("path") or version.source

    def find(self, **tags):
        """The newest version carrying all of `tags` (as registered), or None."""
        want = {k: _tag(v) for k, v in tags.items()}
        found = [v for v in self.client.search_model_versions(f"name='{self.name}'")
                 if all(v.tags.get(k) == x for k, x in want.items())]
        return max(found, key=lambda v: int(v.version)) if found else None

    def alias(self, alias: str):
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_model_version_by_alias(self.name, alias)
        except MlflowException:  # no such alias
            return None

    def set_alias(self, alias: str, version) -> None:
        self.client.set_registered_model_alias(self.name, alias, str(version))

    def compare_and_set_alias(self, alias: str, expected: str | None, version) -> None:
        """Move `alias` to `version` only from `expected` (None: unset); already there: nothing to
        do (a rerun). MLflow has no atomic compare-and-set: this reads, compares, then writes, which
        is exact for the loop (the one writer of its aliases) and catches a person's move between."""
        cur = self.alias(alias)
        now = None if cur is None else str(cur.version)
        if now == str(version):
            return
        if now != (None if expected is None else str(expected)):
            raise AliasConflict(f"alias {alias!r} of {self.name} is v{now}, not v{expected} as when this promotion "
                                f"was recorded: someone moved it; not moved to v{version}")
        self.set_alias(alias, version)

    def ensure_registered(self, path: str, tags: dict, run_id: str | None = None):
        """The newest version of `path`, registered with `tags` if there is none (no alias moves)."""
        return self.version_of(path) or self.register(path, tags, run_id)

    def tag(self, version, **tags) -> None:
        for k, v in tags.items():
            self.client.set_model_version_tag(self.name, str(version), k, _tag(v))

    def best_above(self, serving_v) -> tuple[float, float | None] | None:
        """The best success a promoted version had at its gate, and how far that is above the
        serving version's own at its gate (None where serving has none: the base). Each was
        measured on its own cycle's problems and recorded because it passed, so it reads high (the
        gate selected it); the difference of two such records does not, and the gate adds it to
        serving's success on its own problems (pipelines/validate.py best_here)."""
        recorded = [float(v.tags["promoted_success"]) for v in self.client.search_model_versions(
            f"name='{self.name}'") if "promoted_success" in v.tags]
        if not recorded:
            return None
        own = serving_v.tags.get("promoted_success")
        return max(recorded), None if own is None else max(recorded) - float(own)

    def version_of(self, path: str):
        """The newest version of the checkpoint folder `path`, or None."""
        found = [v for v in self.client.search_model_versions(f"name='{self.name}'") if self.path_of(v) == str(path)]
        return max(found, key=lambda v: int(v.version)) if found else None


class AliasConflict(RuntimeError):
    """An alias is not where a promotion's intent saw it."""


def _tag(v) -> str:
    return v if isinstance(v, str) else json.dumps(v, default=float)[:5000]


def canary(server: AdminClient, seqs, expected: list[list[float]]) -> dict:
    """The server's log-probs of held-out sampled tokens against `expected` (the gate's engine)."""
    deltas = []
    for ids, sampled, want in zip(seqs.ids, seqs.sampled, expected):
        scored = [t for t in range(len(ids) - 1) if sampled[t + 1]]
        got = server.sampled_logprobs(ids, scored)
        deltas += [abs(a - b) for a, b in zip(got, want)]
    mean = sum(deltas) / max(1, len(deltas))
    return {"mean_abs_dlogprob": mean, "max_abs_dlogprob": max(deltas, default=float("nan")),
            "tokens": len(deltas), "finite": all(math.isfinite(d) for d in deltas)}


def intent(registry: Registry, server: AdminClient, version, sha: str) -> dict:
    """What a promotion of `version` (weights `sha`) will change, read before it changes anything:
    the caller writes it down, then calls `promote` with it (also after a kill)."""
    now = server.status()
    old = registry.version_of(now["path"])
    aliases = {a: (str(v.version) if (v := registry.alias(a)) is not None else None) for a in ("serving", "previous")}
    return {"from_path": now["path"], "from_sha": now["checkpoint_sha256"], "from_draft": now.get("draft_path"),
            "from_version": None if old is None else str(old.version), "to_path": registry.path_of(version), "to_sha": sha,
            "to_version": str(version.version), "aliases": aliases}


def promote(registry: Registry, server: AdminClient, version, path: str, cfg: PromoteConfig,
            canary_seqs, expected: list[list[float]], draft_path: str | None = None, plan: dict | None = None
            ) -> Outcome:
    """Swap `version` (which passed the gate) into the server, with its draft when given; keep it
    only if the canary agrees (else the intent's old target and draft go back). `plan`: the
    recorded `intent(...)` (None: read now; a caller that can be killed records it first)."""
    t0 = time.perf_counter()
    plan = plan or intent(registry, server, version, _sha_of(path))
    if plan["to_sha"] == plan["from_sha"]:  # e.g. the serving version gated against itself
        registry.tag(version.version, status="no_op", reason="its weights are the serving ones")
        return Outcome("no_op", version.version, "its weights are the serving ones: nothing to swap",
                       seconds=time.perf_counter() - t0)
    now = server.status()
    fleet = bool(now.get("fleet"))  # a fleet rolls out by canary, in drain mode
    mode = "drain" if fleet else cfg.swap_mode
    if now["checkpoint_sha256"] == plan["to_sha"]:  # a rerun: the swap happened before the kill
        body = {"weight_version": now["weight_version"], "checkpoint_sha256": now["checkpoint_sha256"],
                "path": now["path"], "resumed": True}
    elif now["checkpoint_sha256"] != plan["from_sha"]:
        reason = (f"the server serves {now['checkpoint_sha256'][:12]} ({now['path']}), neither the version this "
                  f"promotion replaces ({plan['from_sha'][:12]}) nor the candidate: not swapped")
        registry.tag(version.version, status="swap_refused", reason=reason)
        return Outcome("swap_refused", version.version, reason, seconds=time.perf_counter() - t0)
    else:
        code, body = server.swap(path, mode, draft_path, sha=plan["to_sha"],
                                 expected_current_sha=plan["from_sha"], canary=cfg.fleet_canary() if fleet else None)
        if code != 200:
            reason = body.get("error", {}).get("message", str(body))
            registry.tag(version.version, status="swap_refused", reason=reason)
            return Outcome("swap_refused", version.version, f"the server refused the swap ({code}): {reason}",
                           seconds=time.perf_counter() - t0)
    failpoint("promote:after_swap")
    check = canary(server, canary_seqs, expected)
    if not (check["finite"] and check["mean_abs_dlogprob"] <= cfg.canary_tolerance):
        back, body_back = server.swap(plan["from_path"], mode, plan["from_draft"] if draft_path else None,
                                      sha=plan["from_sha"], expected_current_sha=plan["to_sha"],
                                      canary={**cfg.fleet_canary(), "seconds": 0} if fleet else None)
        reason = (f"canary after the swap: mean |Δ logprob| {check['mean_abs_dlogprob']:.4g} against the gate's "
                  f"engine (tolerance {cfg.canary_tolerance:g}); swapped back ({back})")
        registry.tag(version.version, status="rolled_back", reason=reason, canary=check)
        return Outcome("rolled_back", version.version, reason, body, check, time.perf_counter() - t0)
    if plan["from_version"] is not None and plan["from_version"] != str(version.version):
        registry.compare_and_set_alias("previous", plan["aliases"]["previous"], plan["from_version"])
        registry.tag(plan["from_version"], status="previous")
    registry.compare_and_set_alias("serving", plan["aliases"]["serving"], version.version)
    failpoint("promote:after_alias")
    registry.tag(version.version, status="serving", server_weight_version=body["weight_version"],
                 swap=body, canary=check)
    return Outcome("serving", version.version, "", body, check, time.perf_counter() - t0)


def _sha_of(path: str) -> str:
    from rollout.artifacts import checkpoint_sha256

    return checkpoint_sha256(path)


def reject(registry: Registry, version, reasons: list[str]) -> Outcome:
    registry.set_alias("rejected", version.version)
    registry.tag(version.version, status="rejected", reason="; ".join(reasons))
    return Outcome("rejected", version.version, "; ".join(reasons))


def rollback(registry: Registry, server: AdminClient, mode: str = "drain") -> Outcome:
    """Put the `previous` version back on the server and in the aliases (serving <-> previous)."""
    t0 = time.perf_counter()
    prev, cur = registry.alias("previous"), registry.alias("serving")
    if prev is None:
        raise ValueError(f"registered model {registry.name} has no `previous` version to roll back to")
    code, body = server.swap(registry.path_of(prev), mode, sha=prev.tags.get("checkpoint_sha256") or None)
    if code != 200:
        raise RuntimeError(f"the server refused to swap back to {registry.path_of(prev)} ({code}): {body}")
    registry.compare_and_set_alias("serving", None if cur is None else cur.version, prev.version)
    registry.tag(prev.version, status="serving", server_weight_version=body["weight_version"])
    if cur is not None and cur.version != prev.version:
        registry.compare_and_set_alias("previous", prev.version, cur.version)
        registry.tag(cur.version, status="rolled_back", reason="loop rollback")
    return Outcome("serving", prev.version, "rolled back", body, seconds=time.perf_counter() - t0)
