"""Trajectory records: derived fields, JSON/JSONL round trips, schema versioning, assembly from
the harness's Episode, the checker's Score and the monitor's HackFlags."""

import json

import pytest

from strop.env.episode import Episode, Segment
from strop.env.grading.checker import Score
from strop.env.grading.hack_monitor import HackFlag
from strop.rl.trajectory import SCHEMA_VERSION, Trajectory, TrajectoryGroup, read_jsonl, write_jsonl


def segment(versions: list[int]) -> Segment:
    seg = Segment(messages=[{"role": "user", "content": "hi"}])
    seg.add_forced([5, 6, 7])
    seg.add_generated(
        [8 + i for i in range(len(versions))], [-0.5] * len(versions), versions, [[[1, 2]] for _ in versions]
    )
    seg.add_forced([9])
    return seg


def test_min_version_is_the_oldest_generated_token():
    t = Trajectory("task", "g0", 1, [segment([4, 3]), segment([5])], 1.0, start_version=2)
    assert t.min_version == 3 and t.generated_tokens == 3 and t.solved and t.key == ("g0", 1)
    # forced tokens carry version -1 and must not count; an episode with nothing generated is as
    # old as the version it was admitted under
    assert Trajectory("task", "g0", 0, [Segment()], 0.0, start_version=7).min_version == 7


def test_json_round_trip_and_schema_version(tmp_path):
    t = Trajectory(
        "task",
        "g0",
        1,
        [segment([4, 3])],
        0.5,
        {"passed": 1},
        [{"kind": "k", "evidence": "e"}],
        "submitted",
        {"total_s": 1.5},
        start_version=3,
    )
    d = json.loads(json.dumps(t.to_dict()))
    assert d["schema_version"] == SCHEMA_VERSION and d["min_version"] == 3
    assert Trajectory.from_dict(d) == t
    with pytest.raises(ValueError, match="schema_version"):
        Trajectory.from_dict({**d, "schema_version": SCHEMA_VERSION + 1})

    path = tmp_path / "t.jsonl"
    write_jsonl(path, [t, t], append=False)
    write_jsonl(path, [t])
    assert read_jsonl(path) == [t, t, t]

    g = TrajectoryGroup("task", "g0", 4, [t])
    assert TrajectoryGroup.from_dict(json.loads(json.dumps(g.to_dict()))) == g
    assert g.rewards == [0.5] and g.min_version == 3


def test_from_episode():
    ep = Episode([segment([2, 2])], [], [], "submitted", 1, {"policy_s": 1.0, "total_s": 2.0})
    score = Score(reward=1.0, passed=3, duration=0.25)
    t = Trajectory.from_episode(
        ep,
        task_id="task",
        group_id="g",
        sample=0,
        score=score,
        hack_flags=[HackFlag("test_edit", "edited tests/")],
        start_version=2,
    )
    assert t.reward == 1.0 and t.breakdown["passed"] == 3 and t.stop_reason == "submitted"
    assert t.hack_flags == [{"kind": "test_edit", "evidence": "edited tests/"}]
    assert t.timings == {"policy_s": 1.0, "total_s": 2.0, "check_s": 0.25}
    assert Trajectory.from_dict(json.loads(json.dumps(t.to_dict()))) == t
