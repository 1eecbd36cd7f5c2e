"""pipelines/speculator on real traffic of the tiny model (episodes from the shared vLLM engine,
written by the real TraceWriter): the offline acceptance estimate is exact where it can be checked,
a traffic-trained draft beats an untrained one of the same size on held-out requests, and the
next draft warm-starts from the previous one."""

from __future__ import annotations

import pytest
import torch

from pipelines.speculator import DraftShape, SpeculatorConfig, SpeculatorManifest, distill, expected_acceptance
from pipelines.speculator.data import traffic_sequences
from pipelines.speculator.distill import load_model, new_draft

SHAPE = DraftShape(hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(scope="module")
def traffic(spec_traffic):
    return spec_traffic


def test_split_is_disjoint_and_only_completions_are_scored(traffic):
    train, held = traffic_sequences(traffic, heldout_fraction=0.25)
    assert train.ids and held.ids and not set(train.episode_ids) & set(held.episode_ids)
    again, _ = traffic_sequences(traffic, heldout_fraction=0.25)
    assert again.episode_ids == train.episode_ids  # a hash split: the same every time
    for ids, m in zip(held.ids, held.sampled):
        assert len(ids) == len(m) and m[0] == 0 and m[-1] == 1 and sorted(m) == list(m)  # prompt, then completion
    with pytest.raises(ValueError, match="no ok requests"):
        traffic_sequences(traffic, weight_versions=[99])


def test_the_target_as_its_own_draft_accepts_every_greedy_token(traffic, tiny_base):
    target = load_model(tiny_base.path)
    _, held = traffic_sequences(traffic, heldout_fraction=0.25)
    exact = expected_acceptance(target, target, held, k=3, temperature=0.0, max_positions=300)
    assert exact.mean_accepted == pytest.approx(3.0) and exact.length == pytest.approx(4.0)
    # at T=1 a greedy proposal is accepted with the target's probability of it: below 1, above 0
    sampled = expected_acceptance(target, target, held, k=3, temperature=1.0, max_positions=300)
    assert 0.1 < sampled.mean_accepted < 3.0 and sampled.positions == 300


def test_traffic_trained_draft_beats_an_untrained_one_and_warm_starts(traffic, tiny_base, tmp_path):
    cfg = SpeculatorConfig(draft=SHAPE, steps=80, batch_size=16, lr=1e-2, warmup_steps=5, heldout_fraction=0.25,
                           eval_positions=400)
    m = distill(tiny_base.path, traffic, tmp_path / "d1", cfg, weight_versions=[0], target_version=0, progress=False)
    assert m.offline["positions"] == 400 and m.parent is None
    untrained, trained = m.offline_before["mean_accepted"], m.offline["mean_accepted"]
    assert trained > 2 * untrained and trained > 0.5, (untrained, trained)
    assert m.history[-1]["loss"] < m.history[0]["loss"]
    assert SpeculatorManifest.load(tmp_path / "d1") == m
    draft = load_model(m.path)  # an HF folder with the target's tokenizer: what vLLM loads as the draft
    assert draft.config.hidden_size == 32 and (tmp_path / "d1" / "tokenizer.json").is_file()
    target = load_model(tiny_base.path)
    assert draft.config.vocab_size == target.config.vocab_size
    assert m.num_parameters < sum(p.numel() for p in target.parameters()) / 2

    again = distill(tiny_base.path, traffic, tmp_path / "d2", SpeculatorConfig(**{**vars(cfg), "steps": 5}),
                    parent=m.path, progress=False)
    assert again.parent == m.path
    assert again.offline_before["mean_accepted"] == pytest.approx(trained, rel=1e-4)  # it started where d1 ended
    with pytest.raises(FileExistsError):
        distill(tiny_base.path, traffic, tmp_path / "d2", cfg, progress=False)


def test_new_draft_takes_the_target_vocabulary_and_its_own_shape(tiny_base):
    target = load_model(tiny_base.path)
    draft = new_draft(target.config, SHAPE)
    x = torch.tensor([[1, 2, 3]])
    assert draft(input_ids=x).logits.shape == target(input_ids=x).logits.shape
    with pytest.raises(ValueError, match="speculator.draft.num_layers"):
        DraftShape(num_layers=0)


def test_hard_labels_need_no_target_forward():
    from pipelines.speculator.distill import distill_loss

    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]], requires_grad=True)
    tokens = torch.tensor([0, 1])
    loss, parts = distill_loss(logits, None, tokens, SpeculatorConfig(soft_weight=0.0, hard_weight=1.0))
    assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(logits, tokens).item())
    assert set(parts) == {"ce"}  # no target logits: no KL, no top-1 agreement to report
