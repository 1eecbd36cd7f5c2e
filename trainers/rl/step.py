"""One RL update's loss, in plain torch around verl's `core_algos` (nothing here knows of Ray).

    logprobs   = log pi_theta(token t+1 | tokens <= t), the model's forward at the temperature
                 token t+1 was sampled at (its logits / T, as verl's actor)       (B, T-1)
    proximal   = the same episode's logprobs at its previous visit (epoch e-1), or this
                 forward's detached on the first visit (ratio 1): the PPO "old" policy, with no
                 extra forward pass; clipping bounds how far an epoch moves each token
    is_weights = verl's truncated importance sampling of the proximal policy against the logged
                 behaviour policy (the served, quantized, possibly older version):
                 min(pi_prox / pi_behaviour, rollout_is_threshold), detached
    loss       = verl's policy loss (clip, dual-clip, agg_loss over the *global* minibatch's
                 sampled tokens, so N data-parallel ranks sum to the 1-rank loss)
                 [- entropy_coeff * entropy] [+ kl_coef * KL(pi_theta || pi_ref)]

Only tokens the policy sampled (loss_mask) enter the loss or the metrics: a prompt's or a tool
result's logprob can be anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainers.rl.config import RLConfig
from trainers.rl.data import Minibatch


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, this rank's share (ranks' losses sum to the global loss)
    metrics: dict[str, float]  # means over this rank's sampled tokens (or its episodes)


def token_logprobs(model, mb: Minibatch, with_entropy: bool = False,
                   entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T-1) logprobs of tokens 1..T-1 under `model`, and their entropies when asked (with a
    gradient only when `entropy_grad`: as a metric it needs none)."""
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    logits = sequence_logits(model, mb)[:, :-1].float()
    if mb.temperatures is not None:  # the distribution each token was sampled from (verl's actor does the same)
        logits = logits / mb.temperatures.unsqueeze(-1)
    logprobs = logprobs_from_logits(logits, mb.input_ids[:, 1:])
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits)
    return logprobs, entropy


def sequence_logits(model, mb: Minibatch) -> torch.Tensor:
    """(B, T, V) logits of the minibatch's rows. A run of rows sharing a prefix (a GRPO group's
    prompt, `mb.runs`) computes it once: the prefix's forward fills a KV cache, repeated for each
    row (gradients flow back through it), and the rows' own tokens attend to it. The same numbers
    as one padded forward, in a fraction of the work when prompts are most of each episode."""
    if not mb.runs:
        return model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    parts = []
    for start, end, prefix in mb.runs:
        att = mb.attention_mask[start:end]
        width = int(att.sum(dim=1).max())
        ids, att = mb.input_ids[start:end, :width], att[:, :width]
        if prefix == 0:
            logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits
        else:
            head = model(input_ids=ids[:1, :prefix], use_cache=True)
            cache = head.past_key_values
            cache.batch_repeat_interleave(end - start)
            tail = model(input_ids=ids[:, prefix:], attention_mask=att, past_key_values=cache, use_cache=True)
            logits = torch.cat([head.logits.expand(end - start, -1, -1), tail.logits], dim=1)
        parts.append(torch.nn.functional.pad(logits, (0, 0, 0, mb.input_ids.shape[1] - width)))
    return torch.cat(parts)


def global_batch_info(cfg: RLConfig, global_tokens: int, global_episodes: int, dp_size: int) -> dict:
    """What verl's agg_loss needs to make each rank's loss its share of the global mean."""
    return {"dp_size": dp_size, "batch_num_tokens": global_tokens, "global_batch_size": global_episodes}


def actor_config(cfg: RLConfig, batch_info: dict):
    """verl's ActorConfig carrying the policy-loss settings (the fields its loss functions read)."""
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                       clip_ratio=cfg.clip_ratio, clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=cfg.loss_agg_mode,
                       policy_loss={"loss_mode": cfg.policy_loss}, global_batch_info=batch_info)


def rl_loss(logprobs: torch.Tensor, proximal: torch.Tensor, mb: Minibatch, cfg: RLConfig, batch_info: dict,
            entropy: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None) -> LossOutput:
    from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
    from verl.utils.torch_functional import masked_mean

    mask = mb.loss_mask
    metrics: dict[str, float] = {}
    is_weights = None
    if cfg.rollout_is is not None:
        is_weights, is_metrics = compute_rollout_correction_weights(
            log_ratio=(proximal - mb.behaviour_logprobs).detach(), response_mask=mask, rollout_is=cfg.rollout_is,
            rollout_is_threshold=cfg.rollout_is_threshold)
        metrics.update({f"is/{k.removeprefix('rollout_is_')}": float(v) for k, v in is_metrics.items()})
    pg_loss, pg_metrics = get_policy_loss_fn(cfg.policy_loss)(
        old_log_prob=proximal.detach(), log_prob=logprobs, advantages=mb.advantages, response_mask=mask,
        loss_agg_mode=cfg.loss_agg_mode, config=actor_config(cfg, batch_info), rollout_is_weights=is_weights)
    loss = pg_loss
    metrics.update({k.replace("actor/", "pg/"): float(v) for k, v in pg_metrics.items()})
    metrics["pg/loss"] = float(pg_loss.detach())
    if entropy is not None:
        ent = agg_loss(entropy, mask, cfg.loss_agg_mode, **batch_info)
        metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
        if cfg.entropy_coeff > 0:
            loss = loss - cfg.entropy_coeff * ent
    if ref_logprobs is not None:
        kl = agg_loss(kl_penalty(logprobs, ref_logprobs, cfg.kl_type), mask, cfg.loss_agg_mode, **batch_info)
        metrics["kl_ref"] = float(kl.detach())
        loss = loss + cfg.kl_coef * kl
    with torch.no_grad():
        gap = (logprobs - mb.behaviour_logprobs).abs()
        metrics["mismatch/train_vs_behaviour"] = float(masked_mean(gap, mask))  # mean |log pi_theta - log pi_b|
        metrics["mismatch/max"] = float((gap * mask).max())
        metrics["advantage/mean"] = float(masked_mean(mb.advantages, mask))
        metrics["advantage/abs_mean"] = float(masked_mean(mb.advantages.abs(), mask))
    metrics["loss"] = float(loss.detach())
    return LossOutput(loss, metrics)
