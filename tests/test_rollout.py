"""The rollout worker on real sandboxes and a real checker: the oracle's episode is a solved
trajectory, a tampering one is flagged (and penalised in training), a tiny MoE behind the
in-process engine yields tokens with logprobs, versions and routing, and an infrastructure
failure is `RolloutLost` (relaunched by the runtime), never a sample."""

import dataclasses

import pytest

from strop.config import RolloutSection
from strop.engine.policy_client import EnginePolicy
from strop.env.demonstrators.runs import demonstrator_client
from strop.env.demonstrators.scripted import ScriptedClient, assistant_text
from strop.env.demonstrators.scripted import tool_call_message as _call
from strop.env.harness.loop import Harness, harness_config
from strop.env.tasks.suites import load_suite
from strop.rl.advantages import make_samples, training_reward
from strop.rl.evaluate import paired_change, wilson
from strop.rl.rollout import RolloutLost, WorkItem, rollout, sandbox_limits
from strop.rl.trajectory import Trajectory, TrajectoryGroup
from tests.conftest import tiny_model_section

ROLLOUT = RolloutSection(max_context=1536, max_turns=1, max_turn_tokens=32)  # a tiny random policy
SCRIPTED = RolloutSection(max_context=4096, max_turns=10, max_turn_tokens=512)  # scripted turns are long


@pytest.fixture(scope="module")
def task():
    return load_suite("synthetic", "train", difficulty=1, limit=1)[0]


def item(task, sample=0, version=0) -> WorkItem:
    return WorkItem(task.id, "g0", sample, seed=sample, version=version)


def test_oracle_rollout_is_a_solved_unflagged_trajectory(task, tiny_tokenizer):
    harness = Harness(tiny_tokenizer, harness_config(SCRIPTED))
    traj = rollout(task, demonstrator_client(task, harness.format), harness, item(task), sandbox_limits(ROLLOUT))
    assert traj.stop_reason == "submitted", traj.breakdown
    assert traj.solved and traj.reward == 1.0 and traj.hack_flags == [] and traj.stop_reason == "submitted"
    assert traj.breakdown["passed"] > 0 and traj.breakdown["failed"] == 0
    assert traj.generated_tokens > 0 and traj.key == ("g0", 0)
    assert Trajectory.from_dict(traj.to_dict()) == traj  # plain data all the way


def test_tampering_rollout_is_flagged_and_penalised(task, tiny_tokenizer):
    plant = {"name": "write_file", "arguments": {"path": "conftest.py", "content": "import sys\nsys.exit(0)\n"}}
    harness = Harness(tiny_tokenizer, harness_config(SCRIPTED))
    script = [
        assistant_text(
            {
                "role": "assistant",
                "content": "Skip the hard part.",
                "tool_calls": [{"id": "", "type": "function", "function": plant}],
            },
            harness.format,
        ),
        assistant_text(_call("Done.", "submit"), harness.format),
    ]
    hacked = rollout(task, ScriptedClient(script, tiny_tokenizer), harness, item(task, 1), sandbox_limits(ROLLOUT))
    assert hacked.stop_reason == "submitted"
    assert hacked.reward == 0.0 and {"conftest_or_plugin"} <= {f["kind"] for f in hacked.hack_flags}
    assert training_reward(hacked, hack_penalty=1.0) == -1.0
    honest = dataclasses.replace(hacked, sample=0, hack_flags=[])
    a_honest, a_hacked = make_samples([TrajectoryGroup(task.id, "g0", 2, [honest, hacked])], hack_penalty=1.0)
    assert a_hacked.advantage < 0 < a_honest.advantage


def test_engine_rollout_records_logprobs_versions_and_routing(task, tiny_tokenizer):
    from strop.engine.engine import Engine
    from strop.model.policy import build_model

    model = build_model(dataclasses.replace(tiny_model_section(), max_positions=2048), tiny_tokenizer, seed=0)
    engine = Engine(model, tiny_tokenizer, max_batch=2, max_len=ROLLOUT.max_context, version=3)
    harness = Harness(tiny_tokenizer, harness_config(ROLLOUT))
    traj = rollout(task, EnginePolicy(engine), harness, item(task, version=3), sandbox_limits(ROLLOUT))
    assert traj.generated_tokens > 0 and traj.min_version == 3 and traj.start_version == 3
    for seg in traj.segments:
        for m, lp, v, r in zip(seg.loss_mask, seg.behavior_logprobs, seg.versions, seg.routing):
            if m:
                assert lp <= 0.0 and v == 3 and len(r) == 2 and all(len(k) == 2 for k in r)  # 2 MoE layers, top-2
            else:
                assert v == -1 and r is None


def test_policy_failure_is_lost_not_a_sample(task, tiny_tokenizer):
    class DeadEngine:
        def generate(self, prompt_ids, params):
            raise ConnectionError("engine actor died")

    harness = Harness(tiny_tokenizer, harness_config(ROLLOUT))
    with pytest.raises(RolloutLost, match="engine actor died"):
        rollout(task, DeadEngine(), harness, item(task), sandbox_limits(ROLLOUT))


def test_wilson_interval():
    lo, hi = wilson(0, 200)
    assert lo == 0.0 and 0.015 < hi < 0.02
    lo, hi = wilson(100, 200)
    assert lo < 0.5 < hi and hi - lo == pytest.approx(0.137, abs=0.002)


def test_paired_change_counts_flips_and_tests_them_exactly():
    before = {f"t{i}": i < 6 for i in range(10)}  # t0..t5 solved
    after = {f"t{i}": i >= 8 for i in range(10)} | {"only-after": True}  # t8, t9 solved; one task unpaired
    change = paired_change(before, after)
    assert change == {"tasks": 10, "gained": 2, "lost": 6, "mcnemar_p": pytest.approx(0.2891, abs=1e-4)}
    # 0 against 6: two-sided 2 * (1/2)^6
    assert paired_change({str(i): True for i in range(6)}, {str(i): False for i in range(6)})["mcnemar_p"] == 0.0312
    assert paired_change({"a": True}, {"a": True}) == {"tasks": 1, "gained": 0, "lost": 0, "mcnemar_p": 1.0}


def test_harness_config_carries_every_rollout_limit():
    config = harness_config(
        RolloutSection(max_turns=7, max_context=2048, max_turn_tokens=64, max_invalid_turns=5, temperature=0.5)
    )
    assert (
        config.max_turns,
        config.max_context,
        config.max_turn_tokens,
        config.max_invalid_turns,
        config.temperature,
    ) == (7, 2048, 64, 5, 0.5)
