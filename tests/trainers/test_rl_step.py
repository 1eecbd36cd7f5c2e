"""The RL step against verl's own functions, called directly on the same tensors, and its masks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainers.rl.config import RLConfig
from trainers.rl.data import Minibatch
from trainers.rl.step import actor_config, global_batch_info, rl_loss


def _minibatch(seed: int = 0, b: int = 4, t: int = 9) -> tuple[Minibatch, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand((b, t - 1), generator=g) > 0.4).float()
    mask[:, 0] = 1
    blp = -torch.rand((b, t - 1), generator=g) * 3 * mask
    adv = torch.randn((b, 1), generator=g) * mask
    mb = Minibatch(torch.randint(0, 50, (b, t), generator=g), torch.ones((b, t), dtype=torch.long), mask, blp, adv,
                   torch.arange(b))
    logprobs = (blp + 0.3 * torch.randn((b, t - 1), generator=g)).requires_grad_(True)
    proximal = blp + 0.1 * torch.randn((b, t - 1), generator=g)
    return mb, logprobs, proximal


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo", "cispo"])
def test_loss_is_verls_policy_loss_with_its_rollout_correction(policy_loss):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    cfg = RLConfig(policy_loss=policy_loss, rollout_is_threshold=1.5)
    mb, logprobs, proximal = _minibatch()
    info = global_batch_info(cfg, int(mb.loss_mask.sum()), 4, 1)
    out = rl_loss(logprobs, proximal, mb, cfg, info)
    w, _ = compute_rollout_correction_weights(proximal - mb.behaviour_logprobs, mb.loss_mask, "token", 1.5)
    want, _ = get_policy_loss_fn(policy_loss)(old_log_prob=proximal, log_prob=logprobs, advantages=mb.advantages,
                                              response_mask=mb.loss_mask, loss_agg_mode=cfg.loss_agg_mode,
                                              config=actor_config(cfg, info), rollout_is_weights=w)
    assert torch.equal(out.loss, want)
    assert out.metrics["is/max"] <= 1.5 and 0 < out.metrics["is/mean"]
    gap = ((logprobs - mb.behaviour_logprobs).abs() * mb.loss_mask).sum() / mb.loss_mask.sum()
    assert out.metrics["mismatch/train_vs_behaviour"] == pytest.approx(float(gap))


def test_kl_and_entropy_terms_are_verls():
    from verl.trainer.ppo.core_algos import agg_loss, kl_penalty

    cfg = RLConfig(kl_coef=0.1, entropy_coeff=0.01)
    mb, logprobs, proximal = _minibatch(1)
    info = global_batch_info(cfg, int(mb.loss_mask.sum()), 4, 1)
    ref, ent = logprobs.detach() - 0.2, torch.rand_like(logprobs)
    base = rl_loss(logprobs, proximal, mb, RLConfig(), info).loss
    out = rl_loss(logprobs, proximal, mb, cfg, info, entropy=ent, ref_logprobs=ref)
    kl = agg_loss(kl_penalty(logprobs, ref, "low_var_kl"), mb.loss_mask, "token-mean", **info)
    e = agg_loss(ent, mb.loss_mask, "token-mean", **info)
    assert torch.allclose(out.loss, base + 0.1 * kl - 0.01 * e)


def test_grpo_advantages_are_verls(rl_dataset):
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    from trainers.rl.data import check_dataset, load_episodes

    eps = load_episodes(check_dataset(rl_dataset.path))
    n = max(m.numel() for m in eps.loss_mask)
    mask = torch.stack([torch.nn.functional.pad(m, (0, n - m.numel())) for m in eps.loss_mask])
    scores = torch.zeros_like(mask)
    scores[:, 0] = eps.rewards
    want, _ = compute_grpo_outcome_advantage(scores, mask, np.array(eps.group_ids, dtype=object))
    got = torch.stack([torch.nn.functional.pad(a, (0, n - a.numel())) for a in eps.advantages])
    assert torch.allclose(got, want, atol=1e-6) and got.abs().sum() > 0
    assert eps.counts["groups"] == 2 and eps.counts["episodes"] == 8


def test_tokens_off_the_mask_change_nothing():
    """A prompt or tool-result token's logprob (train or behaviour) and advantage are not in the loss."""
    cfg = RLConfig()
    mb, logprobs, proximal = _minibatch(2)
    info = global_batch_info(cfg, int(mb.loss_mask.sum()), 4, 1)
    out = rl_loss(logprobs, proximal, mb, cfg, info)
    out.loss.backward()
    off = mb.loss_mask == 0
    assert off.any() and torch.all(logprobs.grad[off] == 0) and torch.any(logprobs.grad[~off] != 0)
    mb2 = Minibatch(mb.input_ids, mb.attention_mask, mb.loss_mask, mb.behaviour_logprobs + 5.0 * off,
                    mb.advantages + 3.0 * off, mb.rows)
    lp2, prox2 = (logprobs.detach() - 7.0 * off).requires_grad_(True), proximal + 2.0 * off
    out2 = rl_loss(lp2, prox2, mb2, cfg, info)
    assert torch.equal(out.loss.detach(), out2.loss.detach())
    assert out.metrics == out2.metrics


def test_ranks_losses_sum_to_the_single_rank_loss():
    """verl's agg_loss with the global token count: each rank's share, times `world`, averages to the 1-rank loss."""
    cfg = RLConfig()
    mb, logprobs, proximal = _minibatch(3, b=6)
    tokens = int(mb.loss_mask.sum())
    whole = rl_loss(logprobs, proximal, mb, cfg, global_batch_info(cfg, tokens, 6, 1)).loss
    parts = []
    for rows in torch.arange(6).tensor_split(2):
        sub = Minibatch(*(x[rows] for x in (mb.input_ids, mb.attention_mask, mb.loss_mask, mb.behaviour_logprobs,
                                            mb.advantages)), rows)
        parts.append(rl_loss(logprobs[rows], proximal[rows], sub, cfg, global_batch_info(cfg, tokens, 6, 2)).loss)
    assert torch.allclose(sum(parts) / 2, whole)


@pytest.mark.parametrize("change, key", [
    (dict(lr=0.0), "lr"), (dict(policy_loss="nope"), "policy_loss"), (dict(adv_estimator="gae"), "adv_estimator"),
    (dict(rollout_is_threshold=0.5), "rollout_is_threshold"), (dict(minibatch_episodes=1, num_workers=2),
                                                               "minibatch_episodes"),
    (dict(clip_ratio_c=1.0), "clip_ratio_c"), (dict(epochs=0), "epochs"), (dict(loss_agg_mode="sum"), "loss_agg_mode"),
])
def test_config_names_the_bad_field(change, key):
    with pytest.raises(ValueError, match=key):
        RLConfig(**change)


def test_grpo_advantages_and_is_weighted_loss_by_hand_on_two_groups_of_three():
    """Two GRPO groups of 3 with rewards (1, 0, 0) and (1, 1, 0); the reward sits on each row's last
    sampled token (trainers/rl/data.py). By hand: mean 1/3 and 2/3, std (ddof 1) sqrt(1/3), so the
    advantages are +-2/sqrt(3) and +-1/sqrt(3), on every sampled token of the row. At ratio 1 the
    vanilla loss is -sum(A * w) / tokens, w = min(exp(proximal - behaviour), threshold)."""
    import math

    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.float32)
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 0])
    last = (mask * torch.arange(3)).argmax(dim=1)
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(6), last] = rewards
    adv, _ = get_adv_estimator_fn("grpo")(token_level_rewards=token_rewards, response_mask=mask,
                                         index=np.array(["a"] * 3 + ["b"] * 3, dtype=object), norm_adv_by_std_in_grpo=True)
    s = 1 / math.sqrt(3)
    by_hand = torch.tensor([2 * s, -s, -s, s, s, -2 * s])[:, None] * mask
    assert torch.allclose(adv, by_hand, atol=1e-5)

    behaviour = torch.full((6, 3), -1.0) * mask
    proximal = behaviour + torch.tensor([0.0, 0.5, 1.0])  # IS ratios 1, e^0.5 = 1.65, e^1 = 2.72 -> 2.0
    weights = torch.tensor([1.0, math.exp(0.5), 2.0])
    cfg = RLConfig(rollout_is_threshold=2.0)
    mb = Minibatch(torch.zeros((6, 4), dtype=torch.long), torch.ones((6, 4), dtype=torch.long), mask, behaviour, adv,
                   torch.arange(6))
    logprobs = proximal.clone().requires_grad_(True)  # ratio 1: nothing clipped
    out = rl_loss(logprobs, proximal, mb, cfg, global_batch_info(cfg, int(mask.sum()), 6, 1))
    want = -(by_hand * weights * mask).sum() / mask.sum()
    assert float(out.loss) == pytest.approx(float(want), abs=1e-6)
    assert out.metrics["is/max"] == pytest.approx(2.0)
