"""Grouped or not: `trainer.adv_estimator: auto` picks verl's estimator from the data (GRPO over
groups, REINFORCE++ over singletons, its group-baseline form over both), the advantages are verl's
own, and the choice reaches the checkpoint's manifest. Singletons are training data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainers.rl.data import NoSignal, check_dataset, load_episodes, resolve_estimator


@pytest.fixture(scope="module")
def datasets(ds_episodes, ds_planted, ds_tokenizer_path, tmp_path_factory):
    """grouped: two problems' groups of 4; singletons: every episode its own round (played once, as
    an outside agent's users do); mixed: the first problem's 4 grouped, the second's alone."""
    make = lambda name, ids: ds_planted(ds_episodes, tmp_path_factory.mktemp(name),  # noqa: E731
                                        ds_tokenizer_path, ids)
    return {"grouped": make("grouped", lambda i: f"rl-{i // 4}-{i % 4}"),
            "singletons": make("singletons", lambda i: f"user{i}-0"),
            "mixed": make("mixed", lambda i: f"rl-0-{i}" if i < 4 else f"user{i}-0")}


@pytest.mark.parametrize("sizes, want", [([4, 4], "grpo"), ([1] * 8, "reinforce_plus_plus"),
                                         ([4, 1, 1, 1, 1], "reinforce_plus_plus_baseline"), ([2, 2, 2], "grpo")])
def test_auto_reads_the_group_sizes(sizes, want):
    name, why = resolve_estimator("auto", sizes)
    assert name == want and why.startswith("auto")
    assert resolve_estimator("rloo", sizes) == ("rloo", "set in trainer.adv_estimator")


def _padded(xs):
    n = max(x.numel() for x in xs)
    return torch.stack([torch.nn.functional.pad(x, (0, n - x.numel())) for x in xs])


@pytest.mark.parametrize("kind, want, episodes", [("grouped", "grpo", 8), ("singletons", "reinforce_plus_plus", 8),
                                                  ("mixed", "reinforce_plus_plus_baseline", 8)])
def test_auto_trains_on_every_kind_of_traffic_with_verls_advantages(datasets, kind, want, episodes):
    from verl.trainer.config.algorithm import AlgoConfig
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    eps = load_episodes(check_dataset(datasets[kind].path), "auto")
    assert eps.estimator == want and eps.counts["episodes"] == episodes, (eps.estimator, eps.counts)
    mask = _padded(eps.loss_mask)
    scores = torch.zeros_like(mask)
    last = (mask * torch.arange(mask.shape[1])).argmax(dim=1)
    scores[torch.arange(len(last)), last] = eps.rewards
    index = np.array(eps.group_ids, dtype=object)
    kwargs = {"config": AlgoConfig(gamma=1.0)} | ({} if want == "reinforce_plus_plus" else {"index": index})
    ref, _ = get_adv_estimator_fn(want)(token_level_rewards=scores, response_mask=mask, **kwargs)
    got = _padded(eps.advantages)
    assert torch.allclose(got, ref, atol=1e-5)
    # a rewarded episode is pushed up, an unrewarded one down
    per_episode = (got * mask).sum(1) / mask.sum(1)
    assert all((a > 0) == (r > 0) for a, r in zip(per_episode.tolist(), eps.rewards.tolist()))


def test_grpo_forced_on_singletons_trains_nothing_and_says_why(datasets):
    """The old behaviour, now only on request: a group baseline has nothing to compare a singleton with."""
    with pytest.raises(NoSignal, match="no trainable episodes"):
        load_episodes(check_dataset(datasets["singletons"].path), "grpo")


def test_the_choice_reaches_the_checkpoint_manifest(datasets, tiny_base, tmp_path):
    from trainers.rl.config import RLConfig
    from trainers.rl.train import TrainJob, train

    job = TrainJob(tiny_base.path, datasets["singletons"].path, str(tmp_path / "ckpt"),
                   RLConfig(epochs=1, minibatch_episodes=8, qat=False, progress=False, num_workers=0))
    ckpt = train(job)
    assert ckpt.adv_estimator == "reinforce_plus_plus" and "no group has 2" in ckpt.adv_estimator_reason
    assert ckpt.metrics["steps"] == 1


def test_a_retokenized_episode_trains_its_segments_with_the_episodes_advantage(ds_episodes, ds_planted,
                                                                             ds_tokenizer_path, tmp_path):
    """An episode split into two rows at a re-tokenized turn counts once in its group, and both rows
    carry its advantage on their own sampled tokens: the same tokens, logprobs and advantages as the
    episode had whole (the split changes which rows hold them, not what is trained)."""
    two_turn = [i for i, (_, ep) in enumerate(ds_episodes) if len(ep.turns) == 2]
    whole = load_episodes(check_dataset(ds_planted(ds_episodes, tmp_path / "whole", ds_tokenizer_path).path), "grpo")
    split = load_episodes(check_dataset(ds_planted(ds_episodes, tmp_path / "split", ds_tokenizer_path,
                                                   retokenized={two_turn[0]}).path), "grpo")
    assert split.counts["episodes"] == whole.counts["episodes"] and split.counts["segment_rows"] == 1
    assert len(split) == len(whole) + 1
    tokens = lambda e: sorted(  # noqa: E731  (each trained token: its id, behaviour logprob, advantage)
        (int(ids[t + 1]), round(float(b[t]), 6), round(float(a[t]), 5))
        for ids, m, b, a in zip(e.input_ids, e.loss_mask, e.behaviour_logprobs, e.advantages)
        for t in torch.nonzero(m).flatten().tolist())
    assert tokens(split) == tokens(whole)
