"""The KL gate's checks and its twin stage on the tiny model, in this machine's serving format:
each planted damage is rejected before any forward with a reason that names it (or, for noise on
one layer, by the drift limit), and a good candidate passes with its KL distributions reported.
The engine stage, the registry and the swap are tested against a running server
(tests/rollout/server/test_promote.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipelines.artifacts import file_sha256
from pipelines.logits import dataset_sequences
from pipelines.validate import GateConfig, KLGate, write_report


def _spec():
    from loop.serving import serving_spec
    from rollout.capabilities import detect

    fmt = next(f for f in detect().formats if f != "none")
    return serving_spec(fmt, 32, "bfloat16")


def _noisy(src, dst, scale, only: str | None = None, seed: int = 3):
    """A copy of an HF folder with Gaussian noise (`scale` x each matrix's std) on its matrices,
    or on the one whose name contains `only`."""
    shutil.copytree(src, dst)
    (dst / "flywheel_manifest.json").unlink(missing_ok=True)
    g = torch.Generator().manual_seed(seed)
    for shard in dst.glob("*.safetensors"):
        t = load_file(shard)
        for k, v in t.items():
            if v.ndim == 2 and v.is_floating_point() and (only is None or only in k):
                t[k] = (v + scale * v.std() * torch.randn(v.shape, generator=g)).contiguous()
        save_file(t, shard, metadata={"format": "pt"})
    return dst


def _rehash(folder):
    """Record the folder's files as they are now in its manifest (damage that a manifest hides)."""
    m = json.loads((folder / "flywheel_manifest.json").read_text())
    m["files"] = {p.name: file_sha256(p) for p in folder.iterdir() if p.is_file() and p.name != "flywheel_manifest.json"}
    (folder / "flywheel_manifest.json").write_text(json.dumps(m))


def _edit_tensors(folder, fn):
    shard = next(folder.glob("*.safetensors"))
    t = load_file(shard)
    fn(t)
    save_file(t, shard, metadata={"format": "pt"})
    _rehash(folder)


@pytest.fixture(scope="module")
def gate_setup(tiny_base, gate_dataset, tmp_path_factory):
    from pipelines.quantize import quantize_checkpoint
    from pipelines.requantize import RequantizeConfig, requantize

    root = tmp_path_factory.mktemp("gate")
    spec = _spec()
    serving = quantize_checkpoint(tiny_base.path, root / "serving", spec).path
    trained = _noisy(tiny_base.path, root / "trained", 0.02)
    calib = dataset_sequences(gate_dataset.path, "train", 8)
    good = requantize(trained, root / "good", spec, calib, RequantizeConfig(max_full_precision_layers=2))[0].path
    noisy = _noisy(tiny_base.path, root / "noisy-fp", 3.0, only="layers.0.mlp.down_proj")
    noisy_q = requantize(noisy, root / "noisy", spec, calib, RequantizeConfig(max_full_precision_layers=2))[0].path
    seqs = dataset_sequences(gate_dataset.path, "heldout", 16)
    return {"root": root, "serving": serving, "trained": str(trained), "good": good, "noisy": (noisy_q, str(noisy)),
            "seqs": seqs}


def _damaged(setup, name):
    dst = setup["root"] / f"bad-{name}"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(setup["good"], dst)
    return dst


def _plant(setup, kind):
    d = _damaged(setup, kind)
    if kind == "nan":
        _edit_tensors(d, lambda t: t["model.norm.weight"].__setitem__(0, float("nan")))
    elif kind == "inf":
        _edit_tensors(d, lambda t: t["model.embed_tokens.weight"].__setitem__((3, 1), float("inf")))
    elif kind == "architecture":
        c = json.loads((d / "config.json").read_text())
        c["num_hidden_layers"] += 1
        (d / "config.json").write_text(json.dumps(c))
        _rehash(d)
    elif kind == "shape":
        _edit_tensors(d, lambda t: t.__setitem__("model.norm.weight", torch.ones(t["model.norm.weight"].numel() + 8)))
    elif kind == "missing":
        _edit_tensors(d, lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
    elif kind in ("truncated", "truncated-rehashed"):
        shard = next(d.glob("*.safetensors"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        if kind == "truncated-rehashed":
            _rehash(d)
    elif kind == "tokenizer":
        c = json.loads((d / "tokenizer_config.json").read_text())
        c["model_max_length"] = 7
        (d / "tokenizer_config.json").write_text(json.dumps(c))
        _rehash(d)
    return d


PLANTED = {
    "nan": "model.norm.weight holds 1 NaN or infinite",
    "inf": "model.embed_tokens.weight holds 1 NaN or infinite",
    "architecture": "architecture differs from the serving model: num_hidden_layers",
    "shape": "tensor model.norm.weight has shape",
    "missing": "missing tensor model.layers.1.post_attention_layernorm.weight",
    "truncated": "does not match its manifest sha256",
    "truncated-rehashed": "cannot be read",
    "tokenizer": "tokenizer differs from the serving model",
}


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_planted_damage_is_rejected_before_any_forward(gate_setup, kind):
    s = gate_setup
    bad = _plant(s, kind)
    report = KLGate(bad, s["trained"], s["serving"], s["seqs"], GateConfig()).measure()
    assert not report.passed and report.stage == "checks", report
    assert len(report.reasons) == 1 and PLANTED[kind] in report.reasons[0], report.reasons
    assert report.reasons[0].startswith("candidate rejected before any forward")


def test_noise_on_one_layer_fails_the_drift_limits(gate_setup, tmp_path):
    s = gate_setup
    gate = KLGate(*s["noisy"], s["serving"], s["seqs"], GateConfig())
    report = gate.measure()
    assert not report.passed and report.stage == "kl"
    assert any(r.startswith("drift kl_mean") and "validate.max_drift_kl_mean" in r for r in report.reasons), report.reasons
    assert not any(r.startswith("quant ") for r in report.reasons)  # noise in fp and quantized alike: not damage
    write_report(gate, tmp_path)
    assert json.loads((tmp_path / "gate_report.json").read_text())["passed"] is False
    assert (tmp_path / "gate_kl.png").stat().st_size > 1000


def test_good_candidate_passes_with_its_distributions(gate_setup, tmp_path):
    s = gate_setup
    gate = KLGate(s["good"], s["trained"], s["serving"], s["seqs"], GateConfig(), stack={"kernel_build": "x"})
    report = gate.measure()
    assert report.passed, report.reasons
    for side in ("quant", "drift"):
        k = getattr(report, side)["kl"]
        assert 0 < k["p50"] <= k["p90"] <= k["p99"] <= k["max"] and 0 < k["mean"] < 0.1, (side, k)
    assert report.heldout["source"].endswith(":heldout") and report.heldout["scored_tokens"] == s["seqs"].num_scored
    assert report.timings["forwards"] == 3 and report.stack == {"kernel_build": "x"}
    # a limit below what was measured fails, naming the key
    strict = KLGate(s["good"], s["trained"], s["serving"], s["seqs"], GateConfig(max_quant_kl_p99=1e-9)).measure()
    assert not strict.passed and strict.reasons == [
        f"quant kl_p99 {report.quant['kl']['p99']:.4g} > validate.max_quant_kl_p99 1e-09"]
