"""The KL gate: may a candidate checkpoint replace the version serving now?

    checks      the candidate against the serving folder, file by file and tensor by tensor
                (pipelines.served): a bad checkpoint is rejected with the reason, nothing runs on it
    KL          over the held-out slice (episodes never trained on), teacher-forced on the same
                tokens, at the positions whose next token the policy sampled:
                  quantization damage  KL(candidate as served || candidate in full precision)
                  policy drift         KL(serving || candidate), both as served
                per-token distributions (mean, p50, p90, p99, max) and top-1 flip rates
    engine      the candidate on the vLLM engine (the caller runs it: loop/gate.py): its own prompt
                log-probs (the whole vocabulary when small, else top-k plus the tail's mass) replace
                the torch twin's for the damage, and its eval success at the serving temperature is
                compared with the serving version's. The twin, which the drift and the plan search
                use, is checked against those engine log-probs (mean |Δ logprob| on the sampled
                tokens within `engine_tolerance`), so the gate measures the served model.

Every threshold is a GateConfig field; a failing report names each threshold it broke.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from pipelines.paired import paired_test

from pipelines.logits import (Sequences, at_temperature, flip_rate, kl, kl_known, model_logprobs, scored_behaviour,
                              scored_counts, scored_targets, scored_temperatures, summary)
from pipelines.ope import episode_log_ratios, ope, per_episode
from pipelines.served import CandidateError, check_candidate, load_twin


@dataclass
class GateConfig:
    heldout_sequences: int = 32  # held-out episodes the KL is measured on
    # Damage: the default model measures mean ~1e-3, p99 ~0.03, flips ~0.5% (W4A16, QAT-trained);
    # the tiny test model ~3e-3 and ~4%. Drift: an RL cycle that doubled success measured mean 0.08,
    # p50 1e-4, p99 2.1, flips 2.7% (a few tokens change a lot); noise on one layer moves most tokens
    # (tiny model: mean 0.5, p50 0.4, flips 28%).
    max_quant_kl_mean: float = 0.02  # nats per sampled token
    max_quant_kl_p99: float = 0.25
    max_quant_flip_rate: float = 0.1
    max_drift_kl_mean: float = 0.25
    max_drift_kl_p99: float = 10.0
    max_drift_flip_rate: float = 0.15
    # The success test (pipelines/paired.py): candidate and serving play the same fresh eval problems
    # in one engine process; promoted when the one-sided (1 - success_alpha) lower bound of the mean
    # paired difference is above min_success_delta. A candidate truly |min_success_delta| worse
    # passes at most success_alpha of the time (bench/gate_power.py measures it).
    min_success_delta: float = -0.05
    success_alpha: float = 0.1
    # A floor against the best success any promoted version had: a chain of slightly worse promotions
    # cannot walk far down. The best is taken on this gate's problems: serving's success here plus
    # how far the best was above serving at their own gates (pipelines/promote.py Registry.best_above),
    # not the best's own record, which its gate selected for reading high (a SQL run's serving
    # version recorded 52.5% at its gate and played 41.5% on a later gate's problems, where a
    # candidate equal to it on the paired test was refused against the 52.5%).
    max_below_best: float = 0.1
    # Off-policy evaluation (pipelines/ope.py): the candidate's reward estimated on the held-out logged
    # episodes (up to ope_sequences) from their behaviour logprobs, weights clipped at ope_clip.
    # success_source: what the success rule reads: "eval" (the paired test on fresh eval problems),
    # "ope" (the OPE interval's one-sided (1 - success_alpha) lower bound of the reward delta must be
    # above min_success_delta), "auto" (eval where the task has eval problems, else OPE). Both are
    # reported whenever both exist, so the estimator is checked against the eval every cycle.
    ope_sequences: int = 512
    # the datasets whose held-out episodes OPE reads, newest first: the cycle's own and earlier
    # cycles' (never trained on; other versions served them, so the serving twin's own weights are
    # the reference the candidate's delta is taken to on each episode). 1: the cycle's own only
    ope_datasets: int = 8
    ope_clip: float = 10.0
    ope_normalize: bool = False  # self-normalized IS (lower variance; overstated RL candidates here)
    success_source: Literal["auto", "eval", "ope"] = "auto"
    engine_tolerance: float | None = None  # twin vs engine mean |Δ logprob|; None: the canary's for the format here
    engine_topk: int = 20  # log-probs per position from the engine when the vocabulary is large
    full_vocab_max: int = 4096  # vocabularies up to this size come back whole

    def __post_init__(self):
        for name in ("max_quant_kl_mean", "max_quant_kl_p99", "max_quant_flip_rate", "max_drift_kl_mean",
                     "max_drift_kl_p99", "max_drift_flip_rate"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.success_alpha < 1:
            raise ValueError(f"success_alpha must be in (0, 1), got {self.success_alpha}")
        if not self.max_below_best >= 0:
            raise ValueError(f"max_below_best must be >= 0, got {self.max_below_best}")
        if self.heldout_sequences < 1 or self.engine_topk < 1 or self.ope_sequences < 2 or self.ope_datasets < 1:
            raise ValueError("heldout_sequences, engine_topk and ope_datasets must be >= 1, ope_sequences >= 2")
        if not self.ope_clip > 1:
            raise ValueError(f"ope_clip must be > 1, got {self.ope_clip}")
        if self.success_source not in ("auto", "eval", "ope"):
            raise ValueError(f"success_source must be auto, eval or ope, got {self.success_source!r}")

    def engine_logprobs_k(self, vocab_size: int) -> int:
        return vocab_size if vocab_size <= self.full_vocab_max else self.engine_topk


@dataclass
class EngineSide:
    """What the engine measured for the candidate as served (loop/gate.py runs it)."""
    logprobs: torch.Tensor  # [num_scored, vocab] log-probs, NaN where the engine returned none
    success: float | None  # eval success at `temperature` (None: no built-in problems played, your agent's task)
    serving_success: float | None  # the serving version's, same problems and temperature
    temperature: float
    num_problems: int
    source: str
    seconds: float
    paired: tuple[list[float], list[float]] | None = None  # per-problem outcomes (candidate, serving)
    best_success: float | None = None  # the best promoted version's success, on these problems where known
    eval_seed: str | None = None  # which eval problems were played


def best_here(best: tuple[float, float | None] | None, serving_here: float | None) -> float | None:
    """The best promoted version's success on this gate's problems: serving's here plus the gap
    `Registry.best_above` found; its own record where either is unknown."""
    if best is None:
        return None
    return best[0] if best[1] is None or serving_here is None else serving_here + best[1]


@dataclass
class GateReport:
    passed: bool
    reasons: list[str]
    stage: str  # how far the gate got: "checks" | "kl" | "engine"
    candidate: str
    candidate_fp: str | None
    serving: str
    heldout: dict = field(default_factory=dict)
    quant: dict = field(default_factory=dict)  # {"kl": summary, "flip_rate", "source"}
    drift: dict = field(default_factory=dict)
    eval: dict = field(default_factory=dict)
    engine_check: dict = field(default_factory=dict)
    ope: dict = field(default_factory=dict)  # pipelines.ope.OPEEstimate on the held-out logged episodes
    success: dict = field(default_factory=dict)  # the success rule that decided: {"source", "delta", "lower", "passed"}
    stack: dict = field(default_factory=dict)
    thresholds: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary_line(self) -> str:
        q, d = self.quant.get("kl", {}), self.drift.get("kl", {})
        verdict = "PASS" if self.passed else "FAIL: " + "; ".join(self.reasons)
        return (f"gate {verdict} | damage KL mean {q.get('mean', float('nan')):.2e} p99 {q.get('p99', float('nan')):.2e} "
                f"| drift KL mean {d.get('mean', float('nan')):.2e} p99 {d.get('p99', float('nan')):.2e} "
                f"| success {_nan(self.eval.get('candidate_success')):.1%} vs {_nan(self.eval.get('serving_success')):.1%}"
                + (f" paired on {self.eval['num_problems']} fresh problems, delta {self.eval['success_delta']:+.3f} "
                   f"(lower bound {self.eval['success_delta_lower']:+.3f})" if "success_delta_lower" in self.eval else "")
                + (f" | OPE on {self.ope['n']} logged episodes: {self.ope['value']:.1%} vs "
                   f"{'serving' if self.ope.get('referenced') else 'logged'} {self.ope['logged']:.1%}, "
                   f"delta {self.ope['delta']:+.3f} (lower bound {self.ope['lower']:+.3f}, ESS {self.ope['ess']:.0f})"
                   if self.ope else ""))


def _episode_ratios(model, s: Sequences, reference=None):
    """Per logged episode of `s`: `model`'s log-ratio to the behaviour it was served by, the
    `reference` model's (zeros without one), its reward, and its group (an episode's segments
    are one episode: their ratios summed)."""
    def ratios(m):
        lp = at_temperature(model_logprobs(m, s), scored_temperatures(s))
        targets = scored_targets(s)
        return episode_log_ratios(lp[torch.arange(len(targets)), targets], scored_behaviour(s), scored_counts(s))

    episodes = s.episode_ids or range(len(s.rewards))
    mine, rewards = per_episode(ratios(model), s.rewards, episodes)
    ref = per_episode(ratios(reference), s.rewards, episodes)[0] if reference is not None else torch.zeros_like(mine)
    group = dict(zip(episodes, s.group_ids)) if s.group_ids else {}  # an episode's segments share its group
    return mine, ref, torch.as_tensor(rewards, dtype=torch.float64), [group.get(e, e) for e in dict.fromkeys(episodes)]


def _nan(x) -> float:
    return float("nan") if x is None else x


def _limits(report: GateReport, cfg: GateConfig, side: str) -> None:
    stats = getattr(report, side)
    for stat, value in (("kl_mean", stats["kl"]["mean"]), ("kl_p99", stats["kl"]["p99"]),
                        ("flip_rate", stats["flip_rate"])):
        key = f"max_{side}_{stat}"
        limit = getattr(cfg, key)
        if not value <= limit:  # NaN fails too
            report.reasons.append(f"{side} {stat} {value:.4g} > validate.{key} {limit:g}")


class KLGate:
    """One gate run: `measure()` (checks, then KL with the torch twins), then `with_engine()`."""

    def __init__(self, candidate: str | Path, candidate_fp: str | Path | None, serving: str | Path,
                 seqs: Sequences, cfg: GateConfig, stack: dict | None = None,
                 ope_seqs: Sequences | list[Sequences] | None = None, has_eval: bool = True):
        self.candidate, self.serving = str(candidate), str(serving)
        self.candidate_fp = str(candidate_fp) if candidate_fp else None
        self.seqs, self.cfg, self.has_eval = seqs, cfg, has_eval
        self.ope_seqs = [ope_seqs] if isinstance(ope_seqs, Sequences) else ope_seqs  # the cycle's first
        if self.decides_by_ope and ope_seqs is None:
            raise ValueError("validate.success_source reads OPE, but the gate got no logged episodes to weigh")
        self.report = GateReport(True, [], "checks", self.candidate, self.candidate_fp, self.serving,
                                 heldout={"source": seqs.source, "sequences": len(seqs.ids),
                                          "tokens": seqs.num_tokens, "scored_tokens": seqs.num_scored},
                                 stack=stack or {}, thresholds=asdict(cfg))
        self.lp: dict[str, torch.Tensor] = {}
        self.per_token: dict[str, torch.Tensor] = {}

    def _fail(self, reason: str) -> GateReport:
        self.report.passed = False
        self.report.reasons.append(reason)
        return self.report

    def measure(self) -> GateReport:
        t0 = time.perf_counter()
        try:
            check_candidate(self.candidate, self.serving)
            cand = load_twin(self.candidate)
            serving = load_twin(self.serving)
            fp = load_twin(self.candidate_fp) if self.candidate_fp else None
        except CandidateError as e:
            return self._fail(f"candidate rejected before any forward: {e}")
        except (OSError, ValueError) as e:
            return self._fail(f"cannot load a checkpoint: {type(e).__name__}: {e}")
        t1 = time.perf_counter()
        self.report.stage = "kl"
        self.lp["candidate"] = model_logprobs(cand, self.seqs)
        self.lp["serving"] = model_logprobs(serving, self.seqs)
        if fp is not None:
            self.lp["fp"] = model_logprobs(fp, self.seqs)
        t2 = time.perf_counter()
        r = self.report
        temps = scored_temperatures(self.seqs)  # KL of the distributions the tokens were drawn from
        at = {k: at_temperature(v, temps) for k, v in self.lp.items()}
        self.per_token["drift"] = kl(at["serving"], at["candidate"])
        r.drift = {"kl": summary(self.per_token["drift"]), "flip_rate": flip_rate(self.lp["serving"], self.lp["candidate"]),
                   "source": "torch twins of both folders as served"}
        if fp is not None:
            self.per_token["quant"] = kl(at["candidate"], at["fp"])
            r.quant = {"kl": summary(self.per_token["quant"]), "flip_rate": flip_rate(self.lp["candidate"], self.lp["fp"]),
                       "source": "torch twin as served vs full precision"}
            _limits(r, self.cfg, "quant")
        _limits(r, self.cfg, "drift")
        if self.ope_seqs:
            self._off_policy(cand, serving)
        r.passed = not r.reasons
        r.timings = {"load_s": round(t1 - t0, 3), "forwards_s": round(t2 - t1, 3), "forwards": len(self.lp),
                     "kl_s": round(time.perf_counter() - t2, 3)}
        r.timings["tokens_per_s"] = round(self.seqs.num_tokens * len(self.lp) / max(t2 - t1, 1e-9), 1)
        return r

    @property
    def decides_by_ope(self) -> bool:
        """The success rule reads OPE: asked to, or `auto` with no eval problems to play."""
        return self.cfg.success_source == "ope" or (self.cfg.success_source == "auto" and not self.has_eval)

    def _off_policy(self, cand, serving) -> None:
        """OPE of the candidate (its torch twin as served, which the engine check holds to the
        engine) on the held-out logged episodes: the cycle's own, and earlier cycles' where given,
        the serving twin's weights the reference on all of them (its delta to the candidate taken
        on the same episodes); decides the success rule when the config says so."""
        parts = [_episode_ratios(cand, s, serving if len(self.ope_seqs) > 1 else None) for s in self.ope_seqs]
        ratios, refs, rewards = (torch.cat([p[i] for p in parts]) for i in range(3))
        clusters = [(k, c) for k, p in enumerate(parts) for c in p[3]]
        est = ope(ratios, rewards, clip=self.cfg.ope_clip, alpha=self.cfg.success_alpha, normalize=self.cfg.ope_normalize,
                  clusters=clusters, reference=refs if len(parts) > 1 else None)
        self.report.ope = est.to_dict() | {"source": ", ".join(s.source for s in self.ope_seqs)}
        passed = round(est.lower, 12) > self.cfg.min_success_delta
        if self.decides_by_ope:
            self.report.success = {"source": "ope", "delta": est.delta, "lower": est.lower, "passed": passed}
        if self.decides_by_ope and not passed:
            self.report.reasons.append(
                f"OPE reward delta {est.delta:+.3f} on {est.n} logged episodes (ESS {est.ess:.0f}): its "
                f"{1 - est.alpha:.0%} lower bound {est.lower:+.3f} is not above validate.min_success_delta "
                f"{self.cfg.min_success_delta:+g}")

    def with_engine(self, engine: EngineSide, tolerance: float) -> GateReport:
        """The engine's measurements of the candidate: the twin check, the served damage, success."""
        r = self.report
        r.stage = "engine"
        self.engine_logprobs = engine.logprobs
        targets = scored_targets(self.seqs)
        rows = torch.arange(len(targets))
        got, twin = engine.logprobs[rows, targets], self.lp["candidate"][rows, targets]
        delta = (got - twin).abs()
        ok = bool(torch.isfinite(delta).all() and delta.mean().item() <= tolerance)
        r.engine_check = {"mean_abs_dlogprob": delta.mean().item(), "max_abs_dlogprob": delta.max().item(),
                          "tokens": len(targets), "tolerance": tolerance, "ok": ok, "source": engine.source}
        if not ok:
            r.reasons.append(f"the torch twin does not match the engine: mean |Δ logprob| "
                             f"{delta.mean().item():.4g} > tolerance {tolerance:g} ({engine.source})")
        if "fp" in self.lp:
            temps = scored_temperatures(self.seqs)
            self.per_token["quant"] = kl_known(at_temperature(engine.logprobs, temps),
                                               at_temperature(self.lp["fp"], temps))
            known = (~torch.isnan(engine.logprobs)).sum(-1).float().mean().item()
            top1 = torch.nan_to_num(engine.logprobs, nan=-math.inf).argmax(-1)
            r.quant = {"kl": summary(self.per_token["quant"]),
                       "flip_rate": (top1 != self.lp["fp"].argmax(-1)).double().mean().item(),
                       "source": f"{engine.source} ({known:.0f} log-probs per position) vs full precision",
                       "twin_kl": r.quant.get("kl")}
            r.reasons = [x for x in r.reasons if not x.startswith("quant ")]
            _limits(r, self.cfg, "quant")
        r.eval = {"candidate_success": engine.success, "serving_success": engine.serving_success,
                  "temperature": engine.temperature, "num_problems": engine.num_problems, "eval_seed": engine.eval_seed}
        if engine.paired is not None:
            self._paired(*engine.paired)
        if engine.best_success is not None:
            floor = round(engine.best_success - self.cfg.max_below_best, 9)
            r.eval["best_success"] = engine.best_success
            if not round(engine.success, 9) >= floor:
                r.reasons.append(f"success {engine.success:.3f} < the best promoted version's {engine.best_success:.3f}"
                                 f" - validate.max_below_best {self.cfg.max_below_best:g}")
        r.timings["engine_s"] = round(engine.seconds, 2)
        r.passed = not r.reasons
        return r

    def _paired(self, candidate: list[float], serving: list[float]) -> None:
        """The paired success test on per-problem outcomes; it decides unless OPE does."""
        r = self.report
        t = paired_test(candidate, serving, margin=self.cfg.min_success_delta, alpha=self.cfg.success_alpha)
        r.eval |= {"candidate_success": t.candidate, "serving_success": t.serving, "num_problems": t.n,
                   "success_delta": t.delta, "success_delta_se": t.se, "success_delta_lower": t.lower,
                   "success_alpha": t.alpha}
        if not self.decides_by_ope:
            r.success = {"source": "eval", "delta": t.delta, "lower": t.lower, "passed": t.passed}
            if not t.passed:
                r.reasons.append(f"paired success delta {t.delta:+.3f} (se {t.se:.3f}): its {1 - t.alpha:.0%} lower "
                                 f"bound {t.lower:+.3f} is not above validate.min_success_delta "
                                 f"{self.cfg.min_success_delta:+g}")
        r.passed = not r.reasons

    def with_agent_eval(self, candidate: list[float], serving: list[float], source: str) -> GateReport:
        """Your agent's eval split played through both versions: the paired test beside OPE, so the
        estimator is checked against a measurement every cycle (it decides only with
        success_source "eval")."""
        if len(candidate) >= 2:
            self._paired(candidate, serving)
            self.report.eval["source"] = source
        return self.report

    def per_episode(self) -> dict[str, dict[str, float]]:
        """{episode id: {"drift"|"quant": mean KL over its scored tokens}} (unknown entries left out)."""
        counts = [sum(m[1:]) for m in self.seqs.sampled]
        out: dict[str, dict[str, float]] = {e: {} for e in self.seqs.episode_ids}
        for side, x in self.per_token.items():
            for eid, chunk in zip(self.seqs.episode_ids, torch.split(x.float(), counts)):
                if len(chunk) and not bool(chunk.isnan().all()):
                    out[eid][side] = float(chunk.nanmean())
        return out


def write_report(gate: KLGate, out_dir: str | Path) -> Path:
    """report.json and the KL histograms (PNG) under `out_dir`; returns the JSON's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gate_report.json"
    path.write_text(json.dumps(gate.report.to_dict(), indent=2, default=float) + "\n")
    if gate.per_token:
        _histograms(gate, out / "gate_kl.png")
    return path


def _histograms(gate: KLGate, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {"quant": "quantization damage: KL(served || full precision)", "drift": "policy drift: KL(serving || candidate)"}
    fig, axes = plt.subplots(1, len(gate.per_token), figsize=(6 * len(gate.per_token), 3.5), squeeze=False)
    for ax, (side, x) in zip(axes[0], gate.per_token.items()):
        x = x[torch.isfinite(x)].clamp_min(1e-9).log10()
        ax.hist(x.numpy(), bins=60, color="#4a7" if gate.report.passed else "#c55")
        limit = getattr(gate.cfg, f"max_{side}_kl_p99")
        ax.axvline(math.log10(max(limit, 1e-9)), color="k", ls="--", lw=1, label=f"p99 limit {limit:g}")
        ax.set(xlabel="log10 KL per sampled token (nats)", ylabel="tokens", title=names[side])
        ax.legend()
    fig.suptitle(("PASS" if gate.report.passed else "FAIL") + f": {Path(gate.candidate).name}")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
