"""A GRPO group's prompt (and the system prompt that ungrouped singletons share) computed once per
step: the same log-probs and gradients as one padded forward of every row, on a QAT-prepared tiny
Qwen2; minibatches hold pieces of groups; a prepared
layer fake-quantizes its weight once per step inside `fake_quant_once`."""

from __future__ import annotations

import pytest
import torch

from kernels import QuantSpec
from trainers.qat import FakeQuantLinear, fake_quant_once, quantize_
from trainers.rl.config import RLConfig
from trainers.rl.data import Episodes
from trainers.rl.step import token_logprobs
from trainers.rl.train import minibatch_plan

VOCAB = 256


def _model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=VOCAB, tie_word_embeddings=True,
                      initializer_range=0.2, max_position_embeddings=128)
    return quantize_(Qwen2ForCausalLM(cfg).float(), QuantSpec.w4a16(32), "prepare")


def _episodes() -> Episodes:
    """Group a: four rows after a 20-token prompt, of different lengths; group b: two identical
    rows; group c: one row. Sampled tokens start at position 15, inside a's prompt."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, VOCAB, (20,), generator=g)
    a = [torch.cat([prompt, torch.randint(3, VOCAB, (n,), generator=g)]) for n in (5, 17, 1, 30)]
    b = torch.randint(3, VOCAB, (25,), generator=g)
    c = torch.randint(3, VOCAB, (12,), generator=g)
    ids = [*a, b, b.clone(), c]
    masks = []
    for x in ids:
        m = torch.zeros(x.numel() - 1)
        m[15:] = 1
        masks.append(m)
    return Episodes(input_ids=ids, loss_mask=masks, behaviour_logprobs=[torch.zeros_like(m) for m in masks],
                    advantages=[torch.randn(m.shape, generator=g) * m for m in masks], rewards=torch.zeros(len(ids)),
                    group_ids=["a"] * 4 + ["b"] * 2 + ["c"], counts={})


def _traffic() -> Episodes:
    """Ungrouped traffic: five singletons (each its own group) after one 12-token system prompt and
    tools, then a prompt and completion of their own; sampled tokens from position 14."""
    g = torch.Generator().manual_seed(2)
    system = torch.randint(3, VOCAB, (12,), generator=g)
    ids = [torch.cat([system, torch.randint(3, VOCAB, (n,), generator=g)]) for n in (9, 30, 4, 17, 22)]
    masks = [torch.cat([torch.zeros(13), torch.ones(x.numel() - 14)]) for x in ids]
    return Episodes(input_ids=ids, loss_mask=masks, behaviour_logprobs=[torch.zeros_like(m) for m in masks],
                    advantages=[torch.randn(m.shape, generator=g) * m for m in masks], rewards=torch.zeros(len(ids)),
                    group_ids=[f"s{i}" for i in range(len(ids))], counts={})


def _logprobs_and_grads(model, mb):
    model.zero_grad(set_to_none=True)
    with fake_quant_once(model):
        lp, _ = token_logprobs(model, mb)
    (lp * mb.advantages).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_runs_cover_the_rows_with_each_groups_common_prefix():
    ep = _episodes()
    mb = ep.minibatch(list(range(7)), share_prefix=8)
    # a: the prompt; b: identical rows share all but their last token; c: one row shares nothing
    assert mb.runs == ((0, 4, 20), (4, 6, 24), (6, 7, 0))
    assert ep.minibatch([0, 1, 4], share_prefix=8).runs == ((0, 2, 20), (2, 3, 0))
    assert ep.minibatch([0, 1], share_prefix=21).runs == ((0, 2, 0),)
    assert ep.minibatch([0, 1]).runs == ()
    # rows of different groups sharing nothing are one run: one batched forward, not one per row
    assert ep.minibatch([6, 0, 4, 1, 2], share_prefix=8).runs == ((0, 3, 0), (3, 5, 20))
    assert ep.minibatch([6, 3, 4], share_prefix=8).runs == ((0, 3, 0),)
    # singletons of different groups: one run sharing the system prompt they all begin with
    tr = _traffic()
    assert tr.minibatch([3, 0, 4, 1, 2], share_prefix=8).runs == ((0, 5, 12),)
    assert tr.minibatch([3, 0, 4, 1, 2], share_prefix=13).runs == ((0, 5, 0),)


@pytest.mark.parametrize("data,rows", [("groups", [3, 0, 2, 1, 5, 4, 6]), ("groups", [6, 3, 4, 2, 0, 1]),
                                       ("traffic", [3, 0, 4, 1, 2])])
def test_shared_prefix_forward_equals_the_padded_forward(data, rows):
    model, ep = _model(), (_episodes() if data == "groups" else _traffic())
    want_lp, want_grads = _logprobs_and_grads(model, ep.minibatch(rows))
    mb = ep.minibatch(rows, share_prefix=8)
    assert any(p for _, _, p in mb.runs)  # rows1: a run of three groups' single rows, then a's prompt
    lp, grads = _logprobs_and_grads(model, mb)
    on = mb.loss_mask.bool()
    assert torch.allclose(lp[on], want_lp[on], atol=1e-5)
    assert set(grads) == set(want_grads)
    for name, g in grads.items():
        assert (g - want_grads[name]).norm() <= 1e-5 * want_grads[name].norm(), name


def test_fake_quant_once_quantizes_each_weight_once_per_step(monkeypatch):
    model, ep = _model(), _episodes()
    calls = []
    real = FakeQuantLinear.fake_quantized_weight
    monkeypatch.setattr(FakeQuantLinear, "fake_quantized_weight", lambda self: calls.append(self) or real(self))
    layers = sum(isinstance(m, FakeQuantLinear) for m in model.modules())
    mb = ep.minibatch(list(range(7)), share_prefix=8)
    _logprobs_and_grads(model, mb)
    assert len(calls) == layers  # 5 forwards (a's prompt and rows, b's, c), one fake-quant each
    calls.clear()
    token_logprobs(model, mb)
    assert len(calls) == 5 * layers  # outside: every forward fake-quantizes again
    calls.clear()
    token_logprobs(model, ep.minibatch([6, 3, 4], share_prefix=8))
    assert len(calls) == layers  # three groups' single rows: one forward
    with torch.no_grad(), fake_quant_once(model):
        token_logprobs(model, mb)
        with torch.enable_grad():
            lp, _ = token_logprobs(model, mb)
    assert lp.requires_grad  # a weight held without grad is not reused where grad is on


@pytest.mark.parametrize("minibatch,piece", [(8, 4), (10, 3), (64, 2), (8, 1)])
def test_minibatches_hold_pieces_of_groups(minibatch, piece):
    group_ids = [f"g{i // 4}" for i in range(40)] + ["h0"] * 2  # ten groups of 4 and one of 2
    plan = minibatch_plan(group_ids, RLConfig(epochs=3, minibatch_episodes=minibatch, prefix_rows=piece), world=1)
    for epoch in range(3):
        steps = [rows.tolist() for e, rows in plan if e == epoch]
        assert sorted(r for rows in steps for r in rows) == list(range(42))  # every row once per epoch
        stretches = 0  # runs of one group's rows inside a minibatch
        for rows in steps:
            assert len(rows) >= minibatch or rows is steps[-1]
            assert len(rows) < minibatch + piece
            groups = [group_ids[r] for r in rows]
            stretches += sum(j == 0 or groups[j - 1] != g for j, g in enumerate(groups))
            if piece >= 4:  # pieces hold whole groups: each group once, its rows together
                assert sum(j == 0 or groups[j - 1] != g for j, g in enumerate(groups)) == len(set(groups))
        assert stretches <= 10 * -(-4 // piece) + -(-2 // piece)  # at most one per piece
    orders = [[r for e, rows in plan if e == epoch for r in rows.tolist()] for epoch in range(3)]
    assert orders[0] != orders[1] != orders[2]  # a shuffle per epoch
