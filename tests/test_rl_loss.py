"""The policy loss and the advantages, against numbers worked out by hand."""

import math

import pytest
import torch

from strop.config import RLSection
from strop.env.episode import Segment
from strop.rl.advantages import group_advantages, make_samples, token_weights, training_reward
from strop.rl.loss import policy_loss
from strop.rl.trajectory import Trajectory, TrajectoryGroup

# One row, four generated tokens: ratios to behavior r = [1, 1.5, 3, 0.5], advantages [1, 1, -1, -1].
# With clip [0.8, 1.28] the surrogates min(rA, clip(r)A) are [1, 1.28, -3, -0.8]; tokens 1 and 3
# are clipped (no gradient), token 2 is not (A < 0 and r > 1: unbounded without a correction).
R = torch.tensor([[1.0, 1.5, 3.0, 0.5]])
A = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
W = torch.full((1, 4), 0.25)
M = torch.ones(1, 4, dtype=torch.bool)
K3 = [0.0, 0.5 - math.log(1.5), 2.0 - math.log(3.0), -0.5 - math.log(0.5)]


def run(rl: RLSection, r=R, a=A, w=W, m=M):
    behavior = torch.log(torch.tensor([[0.5, 0.2, 0.3, 0.4]])).expand_as(r).clone()
    logprobs = (behavior + r.log()).requires_grad_(True)
    loss, metrics = policy_loss(logprobs, behavior, a, w, m, rl)
    loss.backward()
    return loss.item(), logprobs.grad, metrics


def test_ppo_clip_without_correction():
    loss, grad, m = run(RLSection(correction="none"))
    assert loss == pytest.approx(-0.25 * (1 + 1.28 - 3 - 0.8))
    # d(-w * r A)/dlogp = -w r A on unclipped tokens, 0 on clipped ones
    assert grad[0].tolist() == pytest.approx([-0.25, 0.0, 0.75, 0.0])
    assert m["clip_frac"] == 0.5 and m["mask_frac"] == 0.0 and m["trunc_frac"] == 0.0
    assert m["ratio_mean"] == pytest.approx(1.5)
    assert m["k3"] == pytest.approx(sum(K3) / 4, abs=1e-6)
    assert m["tokens"] == 4


def test_tis_caps_the_importance_weight():
    loss, grad, m = run(RLSection(correction="tis", tis_cap=2.0))
    assert loss == pytest.approx(-0.25 * (1 + 1.28 - 2 - 0.8))  # token 2: -3 * (2/3)
    assert grad[0].tolist() == pytest.approx([-0.25, 0.0, 0.5, 0.0])
    assert m["trunc_frac"] == 0.25


def test_icepop_masks_tokens_outside_the_band():
    loss, grad, m = run(RLSection(correction="icepop", mask_low=0.6, mask_high=2.5))
    assert loss == pytest.approx(-0.25 * (1 + 1.28))
    assert grad[0].tolist() == pytest.approx([-0.25, 0.0, 0.0, 0.0])
    assert m["mask_frac"] == 0.5


def test_geo_mask_masks_whole_rows():
    # Row 0's geometric-mean ratio is (1*1.5*3*0.5)^(1/4) = 1.2247; row 1 is on-policy.
    r = torch.cat([R, torch.ones(1, 4)])
    a, w, m = torch.cat([A, A]), torch.cat([W, W]), torch.cat([M, M])
    loss, grad, metrics = run(RLSection(correction="geo_mask", geo_low=0.8, geo_high=1.2), r, a, w, m)
    assert loss == pytest.approx(-0.25 * (1 + 1 - 1 - 1))
    assert grad[0].tolist() == [0.0] * 4
    assert grad[1].tolist() == pytest.approx([-0.25, -0.25, 0.25, 0.25])
    assert metrics["mask_frac"] == 0.5
    loss, _, metrics = run(RLSection(correction="geo_mask", geo_low=0.8, geo_high=1.25), r, a, w, m)
    assert metrics["mask_frac"] == 0.0


def test_kl_penalty_adds_weighted_k3():
    loss, grad, _ = run(RLSection(correction="none", kl_coef=0.1))
    assert loss == pytest.approx(-0.25 * (1 + 1.28 - 3 - 0.8) + 0.1 * 0.25 * sum(K3))
    # d k3 / dlogp = r - 1
    expected = [g + 0.1 * 0.25 * (r - 1) for g, r in zip([-0.25, 0.0, 0.75, 0.0], R[0].tolist())]
    assert grad[0].tolist() == pytest.approx(expected)


def test_reference_kl_pulls_the_logprobs_toward_the_reference():
    # log q = log pi_ref - log pi_theta per token; k3 = (q - 1) - log q, d k3 / dlogp = 1 - q
    log_q = torch.tensor([[0.0, 0.5, -0.5, 1.0]])
    behavior = torch.log(torch.tensor([[0.5, 0.2, 0.3, 0.4]]))
    logprobs = behavior.clone().requires_grad_(True)
    zero = torch.zeros(1, 4)
    loss, m = policy_loss(logprobs, behavior, zero, W, M, RLSection(ref_kl_coef=0.1), behavior + log_q)
    loss.backward()
    k3 = [math.exp(x) - 1 - x for x in log_q[0].tolist()]
    assert loss.item() == pytest.approx(0.1 * 0.25 * sum(k3))
    assert logprobs.grad[0].tolist() == pytest.approx([0.1 * 0.25 * (1 - math.exp(x)) for x in log_q[0].tolist()])
    assert m["ref_kl"] == pytest.approx(sum(k3) / 4) and m["k3"] == 0.0
    assert run(RLSection())[2]["ref_kl"] == 0.0  # no reference given: no anchor


def test_unmasked_positions_do_not_count():
    m = torch.tensor([[True, True, False, False]])
    loss, grad, metrics = run(RLSection(correction="none"), m=m)
    assert loss == pytest.approx(-0.25 * (1 + 1.28))
    assert grad[0, 2:].tolist() == [0.0, 0.0]
    assert metrics["tokens"] == 2 and metrics["ratio_mean"] == pytest.approx(1.25)


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # mean 0.5, unbiased std sqrt(1/3)
    assert group_advantages(r).tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-5)
    assert group_advantages(r, std_normalize=False).tolist() == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages(torch.ones(4)).tolist() == [0.0] * 4


def test_token_weights():
    n = torch.tensor([2, 4])
    assert token_weights(n).tolist() == [0.25, 0.125]
    assert token_weights(n, length_normalize=False, norm_tokens=10).tolist() == [0.05, 0.05]


def _traj(sample: int, reward: float, generated: int, flagged: bool = False) -> Trajectory:
    seg = Segment()
    seg.add_forced([1, 2])
    seg.add_generated([3] * generated, [-0.1] * generated, [0] * generated, None)
    flags = [{"kind": "test_edit", "evidence": "x"}] if flagged else []
    return Trajectory("t", "g", sample, [seg], reward, hack_flags=flags)


def test_make_samples_applies_hack_penalty_and_normalisation():
    group = TrajectoryGroup("t", "g", 3, [_traj(0, 1.0, 2, flagged=True), _traj(1, 1.0, 4), _traj(2, 0.0, 4)])
    assert training_reward(group.trajectories[0], 1.0) == 0.0
    samples = make_samples([group], dr_grpo=True, norm_tokens=8, hack_penalty=1.0)
    # training rewards [0, 1, 0]: mean 1/3
    assert [s.advantage for s in samples] == pytest.approx([-1 / 3, 2 / 3, -1 / 3])
    assert [s.weight for s in samples] == pytest.approx([1 / 24] * 3)
    samples = make_samples([group], hack_penalty=0.0)
    assert samples[2].advantage < 0 < samples[0].advantage == samples[1].advantage
    assert [s.weight for s in samples] == pytest.approx([1 / 6, 1 / 12, 1 / 12])
    # no baseline (the online cycle's): the training rewards are the advantages
    samples = make_samples([group], hack_penalty=1.0, baseline=False)
    assert [s.advantage for s in samples] == [0.0, 1.0, 0.0]


def test_placebo_advantages_ignore_the_reward():
    """`rl.placebo`: the advantages come from noise fixed per trajectory and seed, whatever the
    checker said; the weights are the real ones."""

    def group(rewards):
        return TrajectoryGroup("t", "g", 3, [_traj(i, r, 2 + i) for i, r in enumerate(rewards)])

    real = make_samples([group([1.0, 0.0, 0.0])])
    a = make_samples([group([1.0, 0.0, 0.0])], placebo_seed=0)
    b = make_samples([group([0.0, 0.0, 1.0])], placebo_seed=0)
    assert [s.advantage for s in a] == [s.advantage for s in b] != [s.advantage for s in real]
    assert [s.weight for s in a] == [s.weight for s in real]
    other_seed = make_samples([group([1.0, 0.0, 0.0])], placebo_seed=1)
    assert [s.advantage for s in other_seed] != [s.advantage for s in a]


def test_reward_power_pays_the_last_checks_more_than_the_first():
    """`rl.reward_power`: partial credit raised to a power, so the gap between most checks and all of
    them outweighs the gap between few and some; the hack penalty still applies after it."""
    group = TrajectoryGroup("t", "g", 3, [_traj(i, r, 4) for i, r in enumerate([0.25, 0.5, 0.75, 1.0])])
    linear = [s.advantage for s in make_samples([group])]
    steep = [s.advantage for s in make_samples([group], reward_power=4)]
    assert linear[1] - linear[0] == pytest.approx(linear[3] - linear[2])
    assert steep[3] - steep[2] > 5 * (steep[1] - steep[0])
    flagged = _traj(0, 0.5, 4, flagged=True)
    assert training_reward(flagged, hack_penalty=1.0, power=2) == pytest.approx(0.25 - 1.0)


def test_solve_bonus_sets_a_solve_apart_from_its_near_misses():
    """`rl.solve_bonus`: under partial credit a solve outranks near misses (11 of 12 checks) by more
    than one check, and a solve flagged as gamed earns no bonus, only the penalty."""
    group = TrajectoryGroup("t", "g", 3, [_traj(i, r, 4) for i, r in enumerate([0.5, 11 / 12, 11 / 12, 1.0])])
    linear = [s.advantage for s in make_samples([group])]
    bonus = [s.advantage for s in make_samples([group], solve_bonus=1.0)]
    assert linear[1] > 0 and bonus[1] < 0  # a near miss stops being pushed up next to a solve
    assert bonus[3] - bonus[1] > 2 * (linear[3] - linear[1])
    honest, gamed = _traj(0, 1.0, 4), _traj(1, 1.0, 4, flagged=True)
    assert training_reward(honest, hack_penalty=1.0, solve_bonus=1.0) == pytest.approx(2.0)
    assert training_reward(gamed, hack_penalty=1.0, solve_bonus=1.0) == pytest.approx(0.0)


def test_negative_weight_keeps_only_the_push_up_of_better_samples():
    """`rl.negative_weight=0`: samples below their group's baseline get advantage 0 (forward-only in
    the trainer); the better ones keep their advantages and every token weight is unchanged."""
    group = TrajectoryGroup("t", "g", 3, [_traj(i, r, 4) for i, r in enumerate([0.0, 0.5, 0.5, 1.0])])
    full = make_samples([group])
    positive = make_samples([group], negative_weight=0.0)
    assert [s.advantage for s in positive] == [0.0, 0.0, 0.0, full[3].advantage] and full[0].advantage < 0
    assert [s.weight for s in positive] == [s.weight for s in full]
    half = make_samples([group], negative_weight=0.5)
    assert half[0].advantage == pytest.approx(full[0].advantage / 2)
