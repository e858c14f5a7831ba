"""A long episode in training: a chain episode that summarized its way through several context
windows (real harness, sandbox and demonstrator) is one sample of its group, every segment of it
gets the episode's advantage, and an RL step on a real tiny model trains its summary tokens like
its actions (their logprobs move with the advantage's sign)."""

import dataclasses

import torch

from strop.config import RLSection
from strop.env.demonstrators.chain import ChainDemonstrator
from strop.env.harness.context import SUMMARY_REQUEST
from strop.env.harness.loop import Harness, HarnessConfig, run_task
from strop.env.suites.chain import make_task
from strop.model.policy import build_model
from strop.rl.advantages import make_samples
from strop.rl.trainer import RLTrainer, build_batch, token_logprobs
from strop.rl.trajectory import Trajectory, TrajectoryGroup
from tests.conftest import tiny_model_section

WINDOW = 1800


def summary_mask(seg) -> list[bool]:
    """Per token of `seg`: whether it belongs to the summary generated at the end of the window."""
    if seg.messages[-2]["content"] != SUMMARY_REQUEST:
        return [False] * len(seg)
    start = len(seg) - next(i for i, m in enumerate(reversed(seg.loss_mask)) if not m)
    return [i >= start for i in range(len(seg))]


@torch.no_grad()
def on_policy(model, traj: Trajectory) -> Trajectory:
    """The trajectory with behavior logprobs the model's own (as if it had sampled the tokens)."""
    for seg in traj.segments:
        lp = token_logprobs(model, build_batch([(seg, 0.0, 0.0)], pad_id=0))[0]
        seg.behavior_logprobs = [0.0] + lp.tolist()
    return traj


def test_a_summarized_episode_is_one_sample_and_its_summaries_train(tiny_tokenizer):
    task = make_task(1, "train", 0)
    config = HarnessConfig(
        max_context=WINDOW, max_turn_tokens=200, summary_tokens=128, max_turns=20, context_strategy="summarize"
    )
    harness = Harness(tiny_tokenizer, config)
    long_ep, _ = run_task(harness, ChainDemonstrator(task, harness.format), task)
    assert long_ep.stop_reason == "submitted" and len(long_ep.resets) >= 2, (long_ep.stop_reason, len(long_ep.resets))
    short_ep, _ = run_task(
        Harness(tiny_tokenizer, dataclasses.replace(config, context_strategy="truncation")),
        ChainDemonstrator(task, harness.format),
        task,
    )

    model = build_model(dataclasses.replace(tiny_model_section(), max_positions=WINDOW), tiny_tokenizer)
    trajs = [
        Trajectory(task.id, "g0", i, ep.segments, reward, stop_reason=ep.stop_reason)
        for i, (ep, reward) in enumerate([(long_ep, 1.0), (short_ep, 0.0)])
    ]
    trajs = [on_policy(model, t) for t in trajs]
    samples = make_samples([TrajectoryGroup(task.id, "g0", 2, trajs)])
    assert len(samples) == 2  # the long episode is one sample of its group, whatever its windows
    long_sample = samples[0]
    assert long_sample.advantage > 0 > samples[1].advantage
    # GRPO's per-sample normaliser counts the tokens of every window of the episode
    assert abs(long_sample.weight - 1 / (2 * long_ep.generated_tokens)) < 1e-12

    rl = RLSection(lr=3e-3, correction="none", micro_batch=4, measure_every=0)
    trainer = RLTrainer(model, rl, pad_id=tiny_tokenizer.pad_token_id)
    summarized = [seg for seg in long_ep.segments if any(summary_mask(seg))]
    assert len(summarized) == len(long_ep.resets)

    def summary_logprob() -> float:
        with torch.no_grad():
            total = 0.0
            for seg in summarized:
                lp = token_logprobs(model, build_batch([(seg, 0.0, 0.0)], pad_id=0))[0]
                total += float(lp[torch.tensor(summary_mask(seg)[1:])].sum())
            return total

    before = summary_logprob()
    trainer.step(samples)
    after = summary_logprob()
    assert after > before  # the summaries of a solved episode became more likely, as its actions did
