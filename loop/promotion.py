"""The loop's promote phase: a gated candidate (loop/gate.py's Verdict) onto the server and into
the registry, by pipelines/promote.py, with its intent written down first.

    plan = promotion_intent(cfg, verdict, ep)    # the cycle saves it to loop_state.json, then
    promote_phase(cfg, verdict, ep, plan=plan)   # swap + canary + aliases, or `rejected`
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loop.gate import Verdict


def promotion_intent(cfg, v: Verdict, ep) -> dict:
    """What promoting `v` will change (pipelines.promote.intent), for the caller to write down first."""
    from pipelines.promote import AdminClient, Registry, intent

    registry, server = Registry(cfg.tracking_uri, cfg.promote.model_name), AdminClient(ep.url, ep.admin_token)
    version = registry.client.get_model_version(registry.name, v.version)
    adopt_serving(registry, server)
    return intent(registry, server, version, v.checkpoint_sha256)


def adopt_serving(registry, server) -> None:
    """A registry that never had a `serving` alias gets it on what serves now (validate registered it)."""
    if registry.alias("serving") is None and (found := registry.version_of(server.status()["path"])) is not None:
        registry.compare_and_set_alias("serving", None, found.version)


def promote_phase(cfg, v: Verdict, ep, draft_path: str | None = None, plan: dict | None = None):
    """Swap a passing candidate in (canary-checked; with its draft, when given), or record it as
    rejected. `plan`: the promotion's intent as recorded before (promotion_intent)."""
    import mlflow

    from loop.tracking import start_run
    from pipelines.logits import Sequences
    from pipelines.promote import AdminClient, Registry, promote, reject

    registry, server = Registry(cfg.tracking_uri, cfg.promote.model_name), AdminClient(ep.url, ep.admin_token)
    version = registry.client.get_model_version(registry.name, v.version)
    registry.set_alias("candidate", v.version)  # informational: the last version gated
    adopt_serving(registry, server)
    with start_run(cfg, "promote", tags={"phase": "promote", "registry_version": v.version}):
        if v.passed:
            c = v.canary
            seqs = Sequences(tuple(map(tuple, c["ids"])), tuple(map(tuple, c["sampled"])), c["source"])
            outcome = promote(registry, server, version, v.candidate, cfg.promote, seqs, c["expected"], draft_path,
                              plan=plan)
        else:
            outcome = reject(registry, version, v.reasons)
        mlflow.set_tags({"outcome": outcome.status, "reason": outcome.reason[:4000]})
        mlflow.log_dict(outcome.__dict__, "promote_outcome.json")
        if outcome.status == "serving" and v.summary.get("candidate_success") is not None:
            registry.tag(v.version, promoted_success=v.summary["candidate_success"])  # the gate's floor
        if outcome.swap:
            mlflow.log_metrics({"promote/pause_s": outcome.swap.get("pause_s", 0.0), "promote/seconds": outcome.seconds,
                                "promote/server_weight_version": outcome.swap.get("weight_version", -1)})
    print(f"[loop] registry {registry.name} v{v.version}: {outcome.status}"
          f"{' (' + outcome.reason + ')' if outcome.reason else ''}", flush=True)
    return outcome
