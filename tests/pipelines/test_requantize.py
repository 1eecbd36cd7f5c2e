"""Requantize on the tiny model: the plan keeps to its budget and to vLLM's fused groups, the
checkpoint quantizes exactly the plan's complement and carries the plan, the joint search is never
worse than the one-at-a-time baseline on its slice (a second slice chooses between them), and the
KL a plan was scored with is the KL of the checkpoint written for it (measured again on the loaded
folder)."""

from __future__ import annotations

import json

import pytest
import torch

from kernels import QuantSpec
from kernels.layers import check_fused
from pipelines.logits import dataset_sequences, kl, model_logprobs
from pipelines.requantize import PLAN_FILE, RequantizeConfig, requantize
from pipelines.served import load_twin

SPEC = QuantSpec.w4a16(32, scale_dtype="bfloat16")


@pytest.fixture(scope="module")
def calibration(gate_dataset):
    return dataset_sequences(gate_dataset.path, "train", 8)


@pytest.fixture(scope="module")
def planned(tiny_base, calibration, tmp_path_factory):
    dst = tmp_path_factory.mktemp("rq") / "q"
    manifest, plan = requantize(tiny_base.path, dst, SPEC, calibration, RequantizeConfig(max_full_precision_layers=3))
    return dst, manifest, plan


def test_plan_keeps_its_budget_and_the_checkpoint_follows_it(planned, tiny_base):
    from transformers import AutoModelForCausalLM

    from kernels.layers import linear_names

    dst, manifest, plan = planned
    names = linear_names(AutoModelForCausalLM.from_pretrained(tiny_base.path))
    assert len(plan.full_precision) <= 3 and set(plan.full_precision) <= set(names)
    check_fused(set(plan.full_precision), names)  # all shards of a fused group, or none
    assert set(manifest.ignored_layers) == {"lm_head", *plan.full_precision}
    assert set(manifest.quantized_layers) == set(names) - set(plan.full_precision)
    on_disk = json.loads((dst / PLAN_FILE).read_text())
    assert on_disk["full_precision"] == plan.full_precision and PLAN_FILE in dict(manifest.files)
    assert plan.calibration["source"].endswith(":train") and plan.calibration["scored_tokens"] > 0
    # the joint search starts from the baseline's plan too: never worse than it
    assert plan.joint["kl"] <= plan.one_at_a_time["kl"]
    assert len(plan.one_at_a_time["sensitivity"]) == plan.budget["units"]
    assert plan.evaluated[0]["kl"] == min(e["kl"] for e in plan.evaluated) <= plan.kl
    all_quantized = next(e["kl"] for e in plan.evaluated if e["layers"] == 0)
    assert plan.kl <= all_quantized and all_quantized > 0


def test_scored_kl_is_the_written_checkpoints(planned, tiny_base, calibration):
    """The folder, loaded as the engine would (its dequantized int4 weights), has the KL to full
    precision that the search gave its plan: the search scored the artifact, not a look-alike."""
    dst, _, plan = planned
    fp = load_twin(tiny_base.path)
    served = load_twin(dst)
    measured = kl(model_logprobs(fp, calibration), model_logprobs(served, calibration)).mean().item()
    assert measured == pytest.approx(plan.kl, rel=1e-3, abs=1e-7)


def test_byte_budget_and_zero_budget(tiny_base, calibration, tmp_path):
    _, plan0 = requantize(tiny_base.path, tmp_path / "q0", SPEC, calibration, RequantizeConfig(max_full_precision_layers=0))
    assert plan0.full_precision == [] and plan0.joint["curve"] == [[0, plan0.kl]]
    assert len(plan0.evaluated) == 1 and plan0.one_at_a_time["sensitivity"] == {}  # no search to do
    cfg = RequantizeConfig(max_full_precision_layers=99, max_extra_bytes=20_000)
    _, plan = requantize(tiny_base.path, tmp_path / "qb", SPEC, calibration, cfg)
    from transformers import AutoModelForCausalLM

    from pipelines.requantize import units_of

    units = units_of(AutoModelForCausalLM.from_pretrained(tiny_base.path), SPEC)
    kept = [u for u in units if set(u.layers) <= set(plan.full_precision)]
    assert sum(len(u.layers) for u in kept) == len(plan.full_precision)
    assert sum(u.extra_bytes for u in kept) <= 20_000 < sum(u.extra_bytes for u in units)


def test_the_serving_plan_is_kept_only_within_its_factor(planned, tiny_base, calibration):
    """The layers the server keeps in full precision (plus lm_head, as its config lists them): kept
    when their KL is within keep_serving_plan_within of the searched best (an in-place swap), else
    the searched plan; a plan the units cannot express (half a fused group) is not considered."""
    from transformers import AutoModelForCausalLM

    from pipelines.requantize import search_plan

    _, _, best = planned
    worse = next(e for e in best.evaluated if 0 < e["layers"] <= 3 and e["kl"] > best.kl * 1.01)
    serving = ("lm_head", *worse["full_precision"])

    def plan(**kw):
        model = AutoModelForCausalLM.from_pretrained(tiny_base.path, dtype=torch.float32)
        return search_plan(model, SPEC, calibration, RequantizeConfig(max_full_precision_layers=3, **kw), serving)

    loose = plan(keep_serving_plan_within=worse["kl"] / best.kl * 1.001)
    assert loose.serving_plan["kept"] and loose.full_precision == worse["full_precision"]
    assert loose.kl == pytest.approx(worse["kl"])
    strict = plan(keep_serving_plan_within=None)
    assert not strict.serving_plan["kept"] and strict.full_precision == best.full_precision
    assert strict.serving_plan["kl"] == pytest.approx(worse["kl"])
    qkv = [n for n in best.one_at_a_time["sensitivity"] if "q_proj+" in n][0].split("+")
    model = AutoModelForCausalLM.from_pretrained(tiny_base.path, dtype=torch.float32)
    half = search_plan(model, SPEC, calibration, RequantizeConfig(max_full_precision_layers=3), (qkv[0],))
    assert half.serving_plan == {} and half.full_precision == best.full_precision


@pytest.mark.parametrize("kw, key", [({"max_full_precision_layers": -1}, "max_full_precision_layers"),
                                      ({"search": "random"}, "search"),
                                      ({"calibration_sequences": 0}, "calibration_sequences"),
                                      ({"selection_sequences": -1}, "selection_sequences"),
                                      ({"joint_candidates": 0}, "joint_candidates"),
                                      ({"keep_serving_plan_within": 0.5}, "keep_serving_plan_within")])
def test_config_errors_name_the_key(kw, key):
    with pytest.raises(ValueError, match=key):
        RequantizeConfig(**kw)


def test_nan_weights_make_nan_kl_not_a_plan(tiny_base, calibration, tmp_path):
    """A NaN in the trained weights cannot be planned around: every plan scores NaN, and the plan
    says so (the gate then rejects the candidate)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "nan"
    shutil.copytree(tiny_base.path, src)
    shard = next(src.glob("*.safetensors"))
    tensors = load_file(shard)
    name = next(k for k in tensors if k.endswith("mlp.down_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    _, plan = requantize(src, tmp_path / "q", SPEC, calibration, RequantizeConfig(max_full_precision_layers=2))
    assert torch.isnan(torch.tensor(plan.kl))


def test_a_second_slice_chooses_between_the_joint_plan_and_the_baseline(tiny_base, gate_dataset):
    """The joint search fits the noise of its own slice; with `selection` (episodes it did not
    see) the plan is whichever of the joint plan and the baseline has the lower KL there, as an
    independent scorer on those episodes measures it."""
    from transformers import AutoModelForCausalLM

    from pipelines.requantize import PlanScorer, search_plan, select

    drawn = dataset_sequences(gate_dataset.path, "train", 16)  # 5 here
    calibration, other = drawn.head(3), drawn.rows(3)
    assert not set(calibration.episode_ids) & set(other.episode_ids)

    def model():
        return AutoModelForCausalLM.from_pretrained(tiny_base.path, dtype=torch.float32)

    cfg = RequantizeConfig(max_full_precision_layers=4)  # here the two plans differ, the baseline lower on `other`
    plan = search_plan(model(), SPEC, calibration, cfg, selection=other)
    assert search_plan(model(), SPEC, calibration, cfg).joint == plan.joint  # selection leaves the search alone
    judge = PlanScorer(model(), SPEC, other)
    units = {k: frozenset(getattr(plan, k)["units"]) for k in ("joint", "one_at_a_time")}
    if units["joint"] == units["one_at_a_time"]:
        assert plan.selection == {} and plan.full_precision == plan.joint["plan"]
    else:
        lower = min(units, key=lambda k: judge(units[k]))
        assert plan.selection["chosen"] == lower and plan.full_precision == getattr(plan, lower)["plan"]
        assert plan.selection["joint_kl"] == pytest.approx(judge(units["joint"]), rel=1e-5)
    # the choice itself, between two plans that differ: the lower one on the judge's episodes wins
    # (the lowest and the highest of the plans searched, on the judge's episodes: the joint plan
    # itself can be either there, it was searched on others)
    scored = {frozenset(judge.units.index(u) for u in judge.units if set(u.layers) <= set(e["full_precision"]))
              for e in plan.evaluated}
    lo, hi = min(scored, key=judge), max(scored, key=judge)
    assert judge(lo) < judge(hi)
    picked = select(judge, {"units": sorted(lo)}, {"units": sorted(hi)})
    assert picked["chosen"] == "joint"
    assert select(judge, {"units": sorted(hi)}, {"units": sorted(lo)})["chosen"] == "one_at_a_time"
    assert picked["sequences"] == len(other.ids) and picked["scored_tokens"] == other.num_scored


def test_the_joint_search_draws_from_the_most_sensitive_units(planned, tiny_base, calibration):
    """`joint_candidates` bounds the units the joint search adds or swaps in to the baseline's most
    sensitive ones (and its plan): fewer plans scored, never worse than the baseline, and every
    unit of its plan among them. The default takes every unit of the tiny model."""
    from transformers import AutoModelForCausalLM

    from pipelines.requantize import search_plan

    _, _, full = planned
    assert full.joint["candidates"] == full.budget["units"] <= RequantizeConfig().joint_candidates
    model = AutoModelForCausalLM.from_pretrained(tiny_base.path, dtype=torch.float32)
    narrow = search_plan(model, SPEC, calibration, RequantizeConfig(max_full_precision_layers=3, joint_candidates=2))
    allowed = set(narrow.one_at_a_time["ranked"][:2]) | set(narrow.one_at_a_time["units"])
    assert narrow.joint["candidates"] == len(allowed) < full.budget["units"]
    assert set(narrow.joint["units"]) <= allowed and narrow.joint["kl"] <= narrow.one_at_a_time["kl"]
    assert len(narrow.evaluated) < len(full.evaluated)
