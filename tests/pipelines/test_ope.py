"""Off-policy evaluation on synthetic logged traffic with a known answer: two-token episodes drawn
from a behaviour policy, a candidate's true value computed exactly, and the estimator's value,
interval and ESS checked against it (coverage over repeated draws)."""

from __future__ import annotations

import itertools

import pytest
import torch

from pipelines.ope import episode_log_ratios, ope

K = 4  # tokens per step; an episode is two tokens, its reward depends on both


def _world(seed: int):
    g = torch.Generator().manual_seed(seed)
    behaviour = torch.log_softmax(torch.randn(2, K, generator=g), -1)  # per step, independent
    candidate = torch.log_softmax(behaviour + 0.6 * torch.randn(2, K, generator=g), -1)
    p = torch.rand(K, K, generator=g)  # P(reward 1 | tokens)
    return behaviour, candidate, p


def _value(policy: torch.Tensor, p: torch.Tensor) -> float:
    return sum(float(policy[0, a].exp() * policy[1, b].exp() * p[a, b]) for a, b in itertools.product(range(K), repeat=2))


def _logged(behaviour, candidate, p, n: int, g: torch.Generator):
    """n episodes sampled by `behaviour`: the flat per-token logprobs of both policies and rewards."""
    a = torch.multinomial(behaviour[0].exp(), n, replacement=True, generator=g)
    b = torch.multinomial(behaviour[1].exp(), n, replacement=True, generator=g)
    rewards = (torch.rand(n, generator=g) < p[a, b]).double()
    flat = lambda pol: torch.stack([pol[0, a], pol[1, b]], 1).reshape(-1)  # noqa: E731  episode order
    return flat(candidate), flat(behaviour), rewards


@pytest.mark.parametrize("normalize", [False, True])
def test_the_estimate_finds_the_true_value_and_its_interval_covers_it(normalize):
    behaviour, candidate, p = _world(0)
    truth = _value(candidate, p) - _value(behaviour, p)
    assert abs(truth) > 0.03  # a candidate that differs
    g = torch.Generator().manual_seed(1)
    covered, errors = 0, []
    trials = 60
    for _ in range(trials):
        cand, beh, r = _logged(behaviour, candidate, p, 1500, g)
        est = ope(episode_log_ratios(cand, beh, [2] * len(r)), r, clip=50.0, alpha=0.1, resamples=500, normalize=normalize)
        errors.append(est.value - _value(candidate, p))
        covered += est.lower <= truth
        assert est.lower <= est.delta <= est.upper and 0 < est.ess <= est.n
    bias = sum(errors) / trials
    rmse = (sum(e * e for e in errors) / trials) ** 0.5
    assert abs(bias) < 0.01 and rmse < 0.04, (bias, rmse)
    assert covered / trials >= 0.8, covered  # nominal 0.9, one-sided


@pytest.mark.parametrize("normalize", [False, True])
def test_the_serving_policy_estimates_its_own_logged_reward(normalize):
    behaviour, _, p = _world(2)
    cand, beh, r = _logged(behaviour, behaviour, p, 400, torch.Generator().manual_seed(3))
    est = ope(episode_log_ratios(cand, beh, [2] * len(r)), r, normalize=normalize)
    assert est.value == pytest.approx(float(r.mean())) and est.delta == pytest.approx(0, abs=1e-12)
    assert est.ess == pytest.approx(400) and est.clipped == 0 and est.mean_weight == pytest.approx(1)
    assert est.lower == pytest.approx(0, abs=1e-12)


def test_a_candidate_off_the_logged_support_has_a_small_ess_and_a_wide_interval():
    behaviour, _, p = _world(4)
    far = torch.log_softmax(-4 * behaviour.exp(), -1)  # puts its mass where the behaviour rarely goes
    near = ope(*_ratios_rewards(behaviour, torch.log_softmax(behaviour + 0.01, -1), p))
    off = ope(*_ratios_rewards(behaviour, far, p), clip=1e6)
    assert off.ess < 0.3 * near.ess and (off.upper - off.lower) > 2 * (near.upper - near.lower)
    cut = ope(*_ratios_rewards(behaviour, far, p), clip=2.0)
    assert cut.clipped > 0 and cut.max_weight <= 2.0


def _ratios_rewards(behaviour, candidate, p, n: int = 800):
    cand, beh, r = _logged(behaviour, candidate, p, n, torch.Generator().manual_seed(5))
    return episode_log_ratios(cand, beh, [2] * n), r


def test_bad_logged_data_is_refused_by_name():
    with pytest.raises(ValueError, match="finite"):
        ope([0.0, float("nan")], [1.0, 0.0])
    with pytest.raises(ValueError, match="one log-ratio and one reward"):
        ope([0.0, 0.1], [1.0])


def test_segments_of_one_episode_are_weighed_as_the_episode():
    """A re-tokenized episode is several dataset rows: its importance weight is the product over all
    its sampled tokens (the rows' log-ratios summed), its reward counted once."""
    from pipelines.ope import per_episode

    ratios, rewards = per_episode(torch.tensor([0.1, -0.3, 0.5, 0.2], dtype=torch.float64), [1.0, 1.0, 0.0, 1.0],
                                  ["a", "a", "b", "c"])
    assert torch.allclose(ratios, torch.tensor([-0.2, 0.5, 0.2], dtype=torch.float64)) and rewards == [1.0, 0.0, 1.0]
    whole = ope(torch.tensor([-0.2, 0.5, 0.2]), [1.0, 0.0, 1.0], resamples=200)
    assert ope(ratios, rewards, resamples=200).value == pytest.approx(whole.value)


def test_groups_are_resampled_whole():
    """Eight draws of one prompt move together: resampled as episodes, 50 prompts x 8 look like 400
    independent ones and the interval is ~sqrt(8) too narrow; resampled by group it is the interval
    of the 50 prompts. Singleton groups are the episode bootstrap exactly."""
    behaviour, candidate, p = _world(0)
    cand, beh, r = _logged(behaviour, candidate, p, 50, torch.Generator().manual_seed(3))
    ratios = episode_log_ratios(cand, beh, [2] * len(r))
    width = lambda e: e.upper - e.lower  # noqa: E731
    prompts = ope(ratios, r, clip=50.0, resamples=4000)
    copies = ratios.repeat_interleave(8), r.repeat_interleave(8)
    groups = [f"g{i // 8}" for i in range(400)]
    naive = ope(*copies, clip=50.0, resamples=4000)
    grouped = ope(*copies, clip=50.0, resamples=4000, clusters=groups)
    assert grouped.delta == pytest.approx(naive.delta) == pytest.approx(prompts.delta)
    assert width(grouped) > 2.3 * width(naive) and grouped.clusters == 50 and naive.clusters == 0
    assert width(grouped) == pytest.approx(width(prompts), rel=0.15)
    alone = ope(ratios, r, clip=50.0, resamples=500, clusters=[f"e{i}" for i in range(50)], normalize=True)
    assert (alone.lower, alone.upper) == pytest.approx((ope(ratios, r, clip=50.0, resamples=500, normalize=True).lower,
                                                        ope(ratios, r, clip=50.0, resamples=500, normalize=True).upper))
    with pytest.raises(ValueError, match="one cluster per episode"):
        ope(ratios, r, clusters=["a"])



def test_episodes_another_version_served_estimate_the_delta_to_serving():
    """Held-out episodes of earlier cycles were served by older versions: with the serving version's
    own log-ratios as `reference`, the delta estimates V(candidate) - V(serving) on the very same
    episodes, its interval covering the truth; where serving served them itself (reference 0) it is
    the plain estimate exactly."""
    behaviour, serving, p = _world(6)  # an older version logged the traffic; serving moved since
    candidate = torch.log_softmax(serving + 0.6 * torch.randn(2, K, generator=torch.Generator().manual_seed(7)), -1)
    truth = _value(candidate, p) - _value(serving, p)
    g = torch.Generator().manual_seed(8)
    covered, errors = 0, []
    for _ in range(40):
        a = torch.multinomial(behaviour[0].exp(), 1500, replacement=True, generator=g)
        b = torch.multinomial(behaviour[1].exp(), 1500, replacement=True, generator=g)
        r = (torch.rand(1500, generator=g) < p[a, b]).double()
        ratio = lambda pol: pol[0, a] + pol[1, b] - behaviour[0, a] - behaviour[1, b]  # noqa: E731
        est = ope(ratio(candidate), r, clip=50.0, resamples=500, reference=ratio(serving))
        errors.append(est.delta - truth)
        covered += est.lower <= truth
        assert est.referenced and est.logged != pytest.approx(float(r.mean()))
    assert abs(sum(errors) / 40) < 0.01 and covered / 40 >= 0.8, (sum(errors) / 40, covered)
    cand, beh, r = _logged(behaviour, candidate, p, 400, torch.Generator().manual_seed(9))
    c = episode_log_ratios(cand, beh, [2] * len(r))
    same, plain = ope(c, r, reference=torch.zeros(len(r)), resamples=300), ope(c, r, resamples=300)
    assert (same.delta, same.lower, same.logged) == pytest.approx((plain.delta, plain.lower, plain.logged))
