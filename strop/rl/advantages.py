"""Group-relative advantages and per-token loss weights: the algorithm side of the policy gradient.

The orchestrator turns complete `TrajectoryGroup`s into `Sample`s — each trajectory with one
advantage and one per-token weight — and ships those to the trainer, which only computes
sum over generated tokens of weight * clipped objective(advantage). Choosing the algorithm is
choosing these two numbers:

- GRPO: A_i = (r_i - mean(r)) / (std(r) + eps) within the group; each sample's tokens are
  averaged (weight 1 / (N * n_i) for a sample with n_i generated tokens in a batch of N samples).
- Dr.GRPO (arXiv:2503.20783): A_i = r_i - mean(r), and a constant normaliser instead of n_i
  (weight 1 / (N * norm_tokens)), removing the biases toward long wrong and short right answers.
- No baseline (`baseline=False`, the online cycle's): A_i = r_i, so the reward map's own asymmetry
  (Tab's +0.75 accept, -0.25 reject) decides how hard a rejection pushes. Centred advantages push
  a rejected reply down as hard as an accepted one up, and on a tiny policy that push spreads over
  every token of the reply and garbles it instead of removing it.

Negative advantages are scaled by `negative_weight` (1 by default). At 0 only the samples better
than their group's baseline are reinforced: a failed episode's tokens are not pushed down, and at
a low sampling temperature those are mostly the same tokens the good episodes chose, so pushing
them down can erode the thin margins greedy decoding depends on.

The reward is the checker's (raised to `reward_power`, plus `solve_bonus` for an honest solve),
minus `hack_penalty` when the hack monitor flagged a hack in the episode (`degenerate_penalty` when
its only flags are degenerate loops, stalls or questions). A placebo run (`rl.placebo`) uses
`placebo_reward` instead: noise with the same structure of update.
"""

import random
from dataclasses import dataclass

import torch

from strop.env.grading.hack_monitor import penalized
from strop.rl.trajectory import Trajectory, TrajectoryGroup


@dataclass
class Sample:
    trajectory: Trajectory
    advantage: float  # applies to every generated token of every segment of the trajectory
    weight: float  # per-token loss weight; weights over a batch sum to ~1 (GRPO) or below (Dr.GRPO)
    reward: float  # its training reward (`training_reward`; a placebo run's too, not its noise), for metrics


def training_reward(
    traj: Trajectory,
    hack_penalty: float,
    degenerate_penalty: float = 0.0,
    power: float = 1.0,
    solve_bonus: float = 0.0,
) -> float:
    """The checker's reward (raised to `power` when positive, plus `solve_bonus` for a solve the
    hack monitor did not flag as gamed) less its penalty (`strop.env.grading.hack_monitor.penalized`)."""
    reward = traj.reward**power if traj.reward > 0 else traj.reward
    reward += solve_bonus if traj.solved and not traj.hacked else 0.0
    return penalized(reward, (f["kind"] for f in traj.hack_flags), hack_penalty, degenerate_penalty)


def placebo_reward(traj: Trajectory, seed: int) -> float:
    """Uniform noise in [0, 1), fixed per trajectory (by its group and sample) and run seed."""
    return random.Random(f"placebo/{seed}/{traj.group_id}/{traj.sample}").random()


def group_advantages(rewards_G: torch.Tensor, *, std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """[G] rewards -> [G] advantages; zero everywhere when all rewards are equal (no signal)."""
    centred = rewards_G - rewards_G.mean()
    if not std_normalize:
        return centred
    return centred / (rewards_G.std() + eps)  # unbiased std, as in the GRPO paper's implementations


def token_weights(gen_tokens_N: torch.Tensor, *, length_normalize: bool = True, norm_tokens: int = 1) -> torch.Tensor:
    """[N] generated-token counts -> [N] per-token weights (batch mean of per-sample token means,
    or of per-sample token sums over a constant)."""
    n = gen_tokens_N.numel()
    if length_normalize:
        return 1.0 / (n * gen_tokens_N.clamp(min=1).double())
    return torch.full((n,), 1.0 / (n * norm_tokens), dtype=torch.float64)


def make_samples(
    groups: list[TrajectoryGroup],
    *,
    dr_grpo: bool = False,
    norm_tokens: int = 1024,
    hack_penalty: float = 1.0,
    degenerate_penalty: float = 0.0,
    reward_power: float = 1.0,
    solve_bonus: float = 0.0,
    negative_weight: float = 1.0,
    baseline: bool = True,
    placebo_seed: int | None = None,
) -> list[Sample]:
    """Advantages and weights for one optimizer step's groups (see the module docstring), negative
    advantages scaled by `negative_weight`; with `placebo_seed`, from `placebo_reward`s instead of
    the training rewards."""
    trajs, advs, rewards = [], [], []
    for g in groups:
        group_rewards = [
            training_reward(t, hack_penalty, degenerate_penalty, reward_power, solve_bonus) for t in g.trajectories
        ]
        scored = group_rewards if placebo_seed is None else [placebo_reward(t, placebo_seed) for t in g.trajectories]
        scored_G = torch.tensor(scored, dtype=torch.float64)
        advs += (group_advantages(scored_G, std_normalize=not dr_grpo) if baseline else scored_G).tolist()
        trajs += g.trajectories
        rewards += group_rewards
    advs = [a if a >= 0 else a * negative_weight for a in advs]
    counts = torch.tensor([t.generated_tokens for t in trajs])
    weights = token_weights(counts, length_normalize=not dr_grpo, norm_tokens=norm_tokens).tolist()
    return [Sample(t, a, w, r) for t, a, w, r in zip(trajs, advs, weights, rewards)]
