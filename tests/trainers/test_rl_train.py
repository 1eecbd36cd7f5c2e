"""The training job in this process on the tiny base model and the planted dataset: every
parameter moves, the loss falls, the checkpoint is a servable folder with its manifest, QAT's
convert equals requantizing the latent weights, and bad datasets fail before training."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from kernels import QuantSpec
from rollout.artifacts import MANIFEST, file_sha256
from trainers.rl.config import RLConfig
from trainers.rl.data import DatasetError
from trainers.rl.manifest import load_checkpoint
from trainers.rl.train import TrainJob, train

SPEC = QuantSpec.w4a16(32, scale_dtype="bfloat16")
FAST = dict(lr=1e-3, warmup_steps=0, lr_schedule="constant", minibatch_episodes=8, epochs=2, num_workers=0,
            progress=False)


@pytest.fixture(scope="module")
def trained(tiny_base, rl_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("rl") / "ckpt"
    seen = []
    m = train(TrainJob(tiny_base.path, rl_dataset.path, str(out), RLConfig(**FAST), SPEC.to_dict()),
              report=lambda step, metrics: seen.append((step, metrics)))
    return m, seen


def test_two_steps_move_every_parameter_and_lower_the_loss(trained, tiny_base):
    m, seen = trained
    before = load_file(str(Path(tiny_base.path) / "model.safetensors"))
    after = load_file(str(Path(m.path) / "model.safetensors"))
    assert before.keys() == after.keys()
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged, unchanged
    assert [s for s, _ in seen] == [1, 2] and len(m.history) == 2
    assert m.history[1]["loss"] < m.history[0]["loss"]
    first = m.history[0]
    assert first["pg/pg_clipfrac"] == 0 and first["is/mean"] > 0  # first visit: ratio 1
    for key in ("grad_norm", "entropy", "mismatch/train_vs_behaviour", "advantage/abs_mean", "tokens_per_s",
                "is/max", "reward/mean", "lr"):
        assert key in first and first[key] == first[key], key
    assert m.history[1]["mismatch/train_vs_behaviour"] > first["mismatch/train_vs_behaviour"]  # it moved off


def test_on_policy_data_matches_the_training_forward_at_step_zero(tiny_base, rl_dataset, tmp_path):
    """The dataset's episodes were sampled by vLLM from this very model (float32, T=1): before any
    update the trainer's log-probs of the sampled tokens are the logged ones. An off-by-one between
    the logged positions and the training forward (or logits at another temperature) is ~1 nat."""
    seen = []
    job = TrainJob(tiny_base.path, rl_dataset.path, str(tmp_path / "ckpt"),
                   RLConfig(**{**FAST, "epochs": 1, "qat": False}), None)
    train(job, report=lambda step, metrics: seen.append(metrics))
    assert seen[0]["mismatch/train_vs_behaviour"] < 1e-3, seen[0]


def test_tokens_sampled_at_temperature_07_are_trained_at_it(tiny_base, ds_traces, ds_write, tmp_path):
    """Episodes sampled by the model itself at T=0.7, their logged logprobs those of softmax(logits /
    0.7) (what vLLM's processed_logprobs are): before any update the trainer's log-probs are the
    logged ones only if it scales its logits by the temperature each token was sampled at. On
    c8fb06b (logits at T=1) the step-0 mismatch was 0.072 nats per token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelines.traces_to_dataset import DatasetConfig, build_dataset
    from rollout.episode import Completion, hf_generate, run_episodes
    from rollout.tasks.calculator import TASK, make_problems
    from rollout.traces import Feedback

    t = 0.7
    model = AutoModelForCausalLM.from_pretrained(tiny_base.path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_base.path)
    torch.manual_seed(0)
    problems = [p for p in make_problems("train", 2, seed=11) for _ in range(4)]
    episodes = run_episodes(problems, tok, hf_generate(model, tok), task=TASK, temperature=t, max_tokens=32)
    traces, feedback = [], []
    with torch.no_grad():
        for i, ep in enumerate(episodes):
            for turn in ep.turns:  # the sampler's own distribution at each sampled token
                ids = torch.tensor([turn.prompt_ids + turn.completion.token_ids])
                lp = torch.log_softmax(model(ids).logits[0, :-1] / t, -1)
                pos = range(len(turn.prompt_ids) - 1, ids.shape[1] - 1)
                turn.completion = Completion(turn.completion.token_ids, [float(lp[p, ids[0, p + 1]]) for p in pos],
                                             turn.completion.finish_reason)
            tr = ds_traces(ep, f"t07-{i // 4}-{i % 4}", temperature=t)
            traces += tr
            feedback.append(Feedback(trace_id=tr[-1].trace_id, episode_id=tr[-1].episode_id, reward=float(i % 2),
                                     source="env:planted", created_at=tr[-1].created_at))
    ds_write(tmp_path / "data", traces, feedback)
    ds = build_dataset(DatasetConfig(trace_root=tmp_path / "data", out_dir=tmp_path / "ds", tokenizer=tiny_base.path,
                                     heldout_fraction=0.0, feedback_mode="override"))
    seen = []
    job = TrainJob(tiny_base.path, ds.path, str(tmp_path / "ckpt"), RLConfig(**{**FAST, "epochs": 1, "qat": False}))
    train(job, report=lambda step, metrics: seen.append(metrics))
    assert seen[0]["mismatch/train_vs_behaviour"] < 1e-3, seen[0]


def test_a_fixed_job_start_proximal_clips_every_step_against_the_parent(tiny_base, rl_dataset, tmp_path):
    """Two minibatches in one epoch: with `previous_visit` the second one's first visit has ratio 1
    (its old policy is this very forward); with `job_start` its old policy is the parent's, which
    the first step moved away from."""
    kl = {}
    for mode in ("previous_visit", "job_start"):
        seen = []
        rl = RLConfig(**{**FAST, "epochs": 1, "minibatch_episodes": 4, "qat": False, "proximal": mode})
        train(TrainJob(tiny_base.path, rl_dataset.path, str(tmp_path / mode), rl), report=lambda s, m: seen.append(m))
        kl[mode] = [m["pg/ppo_kl"] for m in seen]
        assert (seen[0]["proximal_forward_s"] > 0) == (mode == "job_start")
    assert kl["previous_visit"] == [0.0, 0.0]
    assert abs(kl["job_start"][0]) < 1e-6 < abs(kl["job_start"][1])  # step 1: the parent itself (float noise)


def test_qat_leaves_the_layers_the_serving_plan_keeps_in_full_precision(tiny_base):
    from trainers.qat import FakeQuantLinear
    from trainers.rl.train import prepare_policy

    kept = "model.layers.0.mlp.down_proj"
    model = prepare_policy(tiny_base.path, RLConfig(**FAST), SPEC.to_dict(), (kept,))
    fake = {n for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)}
    assert kept not in fake and type(model.get_submodule(kept)) is torch.nn.Linear
    assert "model.layers.0.mlp.up_proj" in fake and "model.layers.1.mlp.down_proj" in fake


def test_the_checkpoint_is_a_folder_with_its_manifest(trained, tiny_base, rl_dataset):
    m, _ = trained
    folder = Path(m.path)
    assert load_checkpoint(folder).to_dict() == json.loads(json.dumps(m.to_dict()))
    parent = {p.name for p in Path(tiny_base.path).iterdir()}
    assert {p.name for p in folder.iterdir()} == parent and "tokenizer_config.json" in parent  # all it needs to serve
    assert all(file_sha256(folder / rel) == h for rel, h in m.files.items()) and MANIFEST not in m.files
    assert m.parent == str(Path(tiny_base.path).resolve()) and m.spec == SPEC.to_dict()
    assert m.dataset_manifest_sha256 == file_sha256(Path(rl_dataset.path) / MANIFEST)
    assert m.data["episodes"] == 8 and m.data["groups_all_equal_reward"] == 0
    assert m.config["qat"] is True and m.metrics["steps"] == 2 and m.wall_seconds > 0


def test_qat_convert_equals_requantizing_the_latent_weights(trained, tmp_path):
    from pipelines.quantize import quantize_checkpoint
    from trainers.qat import quantize_
    from trainers.rl.train import prepare_policy

    m, _ = trained
    model = prepare_policy(m.path, RLConfig(**FAST), m.spec)
    quantize_(model, SPEC, "convert")
    quantize_checkpoint(m.path, tmp_path / "q", SPEC, parent=m.path)
    served = load_file(str(tmp_path / "q" / "model.safetensors"))
    layers = {n: mod for n, mod in model.named_modules() if type(mod).__name__ == "QuantizedLinear"}
    assert layers
    for name, layer in layers.items():
        for key, t in layer.compressed_tensors().items():
            assert torch.equal(served[f"{name}.{key}"], t), f"{name}.{key}"


def _expect_refusal(tiny_base, folder: Path, tmp_path: Path, match: str):
    out = tmp_path / "never"
    with pytest.raises(DatasetError, match=match):
        train(TrainJob(tiny_base.path, str(folder), str(out), RLConfig(**FAST), SPEC.to_dict()))
    assert not out.exists()


def test_a_truncated_dataset_fails_before_training(tiny_base, dataset_copy, tmp_path):
    part = next((dataset_copy / "train").glob("*.parquet"))
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    _expect_refusal(tiny_base, dataset_copy, tmp_path, f"{part.name}.*truncated")


def test_a_dataset_of_another_schema_fails_before_training(tiny_base, dataset_copy, tmp_path):
    part = next((dataset_copy / "train").glob("*.parquet"))
    t = pq.read_table(part)
    t = t.set_column(t.schema.get_field_index("reward"), "reward", pa.array([str(x) for x in t["reward"].to_pylist()]))
    pq.write_table(t, part)
    manifest = json.loads((dataset_copy / MANIFEST).read_text())
    manifest["files"][f"train/{part.name}"] = file_sha256(part)  # a consistent manifest: only the schema is off
    (dataset_copy / MANIFEST).write_text(json.dumps(manifest))
    _expect_refusal(tiny_base, dataset_copy, tmp_path, "schema differs.*reward")


def test_a_folder_without_a_manifest_is_not_a_dataset(tiny_base, dataset_copy, tmp_path):
    (dataset_copy / MANIFEST).unlink()
    _expect_refusal(tiny_base, dataset_copy, tmp_path, "not an RL dataset")


def test_same_seed_same_weights_and_bfloat16_trains(tiny_base, rl_dataset, tmp_path):
    one = dict(FAST, max_steps=1)
    runs = [train(TrainJob(tiny_base.path, rl_dataset.path, str(tmp_path / f"s{i}"), RLConfig(**one), SPEC.to_dict()))
            for i in range(2)]
    a, b = (load_file(str(Path(m.path) / "model.safetensors")) for m in runs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    bf = train(TrainJob(tiny_base.path, rl_dataset.path, str(tmp_path / "bf16"), RLConfig(**one, dtype="bfloat16"),
                        SPEC.to_dict()))
    w = load_file(str(Path(bf.path) / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in w.values()) and bf.history[0]["loss"] == bf.history[0]["loss"]


def test_a_dataset_without_signal_is_refused_as_such(tiny_base, dataset_copy, tmp_path):
    """All rewards equal in every group: nothing to learn; the loop ends the cycle on NoSignal."""
    from trainers.rl.data import NoSignal

    part = next((dataset_copy / "train").glob("*.parquet"))
    t = pq.read_table(part)
    t = t.set_column(t.schema.get_field_index("reward"), t.schema.field("reward"), pa.array([0.5] * t.num_rows))
    pq.write_table(t, part)
    manifest = json.loads((dataset_copy / MANIFEST).read_text())
    manifest["files"][f"train/{part.name}"] = file_sha256(part)
    (dataset_copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(NoSignal, match="all equal"):
        train(TrainJob(tiny_base.path, str(dataset_copy), str(tmp_path / "never"), RLConfig(**FAST), SPEC.to_dict()))
    assert not (tmp_path / "never").exists()
