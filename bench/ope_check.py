"""Off-policy evaluation checked against the truth, on a finished `loop run`.

    ./fw python bench/ope_check.py --run runs/agent_rl [--clip 10] [--alpha 0.1]

For every candidate the run gated (gates/*/gate_report.json): the OPE estimate of its reward on the
held-out logged episodes the gate read (pipelines/ope.py, the candidate's torch twin as served against
the logged behaviour logprobs; the cycle's own and, since `validate.ope_datasets`, earlier cycles',
the serving twin the reference there) beside what the gate measured by playing fresh eval problems on the
engine, paired with the serving version. Prints one row per cycle, the mean absolute error of the
estimated delta against the measured one, and how often the OPE rule (lower bound of the delta above
validate.min_success_delta) decides as the paired eval did. Reports written after OPE joined the
gate carry it already (`ope`); older ones are estimated here on the cycle's own held-out episodes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's packages, not bench/kernels.py


def estimate(report: dict, clip: float, alpha: float, normalize: bool) -> dict:
    from pipelines.logits import (at_temperature, dataset_sequences, model_logprobs, scored_behaviour, scored_counts,
                                  scored_targets, scored_temperatures)
    from pipelines.ope import episode_log_ratios, ope
    from pipelines.served import load_twin

    if report.get("ope") and report["ope"].get("normalized", True) == normalize:
        return report["ope"]
    dataset = report["heldout"]["source"].rsplit(":", 1)[0]
    seqs = dataset_sequences(dataset, "heldout", 512)
    lp = at_temperature(model_logprobs(load_twin(report["candidate"]), seqs), scored_temperatures(seqs))
    targets = scored_targets(seqs)
    ratios = episode_log_ratios(lp[torch.arange(len(targets)), targets], scored_behaviour(seqs), scored_counts(seqs))
    return ope(ratios, seqs.rewards, clip=clip, alpha=alpha, normalize=normalize).to_dict()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a loop run_dir")
    p.add_argument("--clip", type=float, default=10.0)
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--margin", type=float, default=-0.05, help="validate.min_success_delta")
    p.add_argument("--normalize", action="store_true", help="self-normalized IS (validate.ope_normalize)")
    a = p.parse_args()
    reports = sorted(Path(a.run, "gates").glob("*/gate_report.json"), key=lambda f: f.stat().st_mtime)
    rows = []
    print("| cycle | OPE value | logged | OPE delta [lower, upper] | ESS / n | eval cand | eval serving | eval delta "
          "[lower] | OPE rule | eval rule |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k, f in enumerate(reports, 1):
        r = json.loads(f.read_text())
        if "success_delta" not in r.get("eval", {}):
            continue  # stopped before the engine stage
        o, e = estimate(r, a.clip, a.alpha, a.normalize), r["eval"]
        by_ope, by_eval = o["lower"] > a.margin, e["success_delta_lower"] > a.margin
        rows.append((o, e, by_ope, by_eval))
        print(f"| {k} | {o['value']:.3f} | {o['logged']:.3f} | {o['delta']:+.3f} [{o['lower']:+.3f}, {o['upper']:+.3f}] "
              f"| {o['ess']:.0f} / {o['n']} | {e['candidate_success']:.3f} | {e['serving_success']:.3f} | "
              f"{e['success_delta']:+.3f} [{e['success_delta_lower']:+.3f}] | {'pass' if by_ope else 'fail'} | "
              f"{'pass' if by_eval else 'fail'} |")
    if rows:
        mae_delta = sum(abs(o["delta"] - e["success_delta"]) for o, e, _, _ in rows) / len(rows)
        mae_value = sum(abs(o["value"] - e["candidate_success"]) for o, e, _, _ in rows) / len(rows)
        agree = sum(b1 == b2 for _, _, b1, b2 in rows) / len(rows)
        print(f"\n{len(rows)} candidates: MAE of the OPE delta vs the paired eval delta {100 * mae_delta:.1f} points; "
              f"of the OPE value vs the candidate's eval success {100 * mae_value:.1f} points (different prompts: the "
              f"logged train draw vs fresh eval problems); decisions agree {agree:.0%}")


if __name__ == "__main__":
    main()
