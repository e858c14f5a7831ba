"""The curriculum at the policy's edge (`strop.rl.curriculum`): estimates per task and difficulty,
the exploration floor, seeded draws, resumable state; and on the orchestrator's loop (simulated
runtime, tasks that are always, never or sometimes solved) more groups with a learning signal than
uniform sampling on the same steps and seed."""

import random
from dataclasses import dataclass

from strop.env.episode import Segment
from strop.rl.curriculum import EdgeSampler, solve_by_difficulty
from strop.rl.orchestrator import Orchestrator
from strop.rl.trajectory import Trajectory
from tests.test_orchestrator import SimRuntime, config, rows


@dataclass
class Group:
    task_id: str
    trajectories: list


def group(task_id: str, solved: list[bool]) -> Group:
    return Group(task_id, [Trajectory(task_id, "g", i, [], float(s)) for i, s in enumerate(solved)])


def test_edge_sampler_draws_where_the_policy_sometimes_succeeds():
    tasks = ["easy", "hard", "edge1", "edge2", "unseen"]
    levels = {"easy": 1, "hard": 3, "edge1": 2, "edge2": 2, "unseen": 3}
    s = EdgeSampler(tasks, levels, seed=0, explore=0.0, memory=0.5)
    s.observe([group("easy", [True] * 4), group("hard", [False] * 4), group("edge1", [True, False, False, False])])
    assert s.rate == {"easy": 1.0, "hard": 0.0, "edge1": 0.25} and s.at_edge() == ["edge1"]
    drawn = [s.next()[1] for _ in range(20)]
    assert set(drawn) == {"edge1"}  # no exploration: only the task at the edge
    s.observe([group("edge1", [True] * 4)])  # 0.25 -> 0.625: still at the edge
    assert s.rate["edge1"] == 0.625 and s.by_difficulty == {1: 1.0, 3: 0.0, 2: 0.625}
    s.observe([group("edge1", [True] * 4)] * 30)
    assert s.at_edge() == []  # solved: its estimate reaches 1
    # nothing at the edge: never-drawn tasks first (the exploration floor), then the difficulty at the edge
    assert {s.next()[1] for _ in range(10)} <= {"edge2", "unseen"}
    s.observe([group("edge2", [False] * 4), group("unseen", [False] * 4)])
    s.by_difficulty[2] = 0.5
    assert {s.next()[1] for _ in range(10)} <= {"edge1", "edge2"}  # difficulty 2 is at the edge

    explorer = EdgeSampler(tasks, levels, seed=0, explore=0.5, memory=0.5)
    explorer.observe([group("edge1", [True, False])])
    drawn = [explorer.next()[1] for _ in range(200)]
    assert 60 < drawn.count("edge1") < 140 and {"easy", "hard", "unseen"} <= set(drawn)  # half explores

    again = EdgeSampler(tasks, levels, seed=0, explore=0.5, memory=0.5)
    again.load_state_dict(explorer.state_dict())
    assert [again.next() for _ in range(5)] == [explorer.next() for _ in range(5)]  # a resume draws the same

    assert solve_by_difficulty([group("easy", [True, True]), group("edge1", [True, False])], levels) == {
        "solve_rate_d1": 1.0,
        "solve_rate_d2": 0.5,
    }


class Skilled(SimRuntime):
    """A policy that always solves `easy*` tasks, never `hard*` ones, and half of `edge*` ones."""

    def _run(self, item, delay):
        seg = Segment()
        seg.add_forced([1, 2])
        seg.add_generated([3, 4], [-0.5, -0.5], [self._version, self._version], None)
        chance = {"easy": 1.0, "hard": 0.0, "edge": 0.5}[item.task_id.rstrip("0123456789")]
        reward = float(random.Random(f"{item.group_id}/{item.sample}").random() < chance)
        self.done.put((item, Trajectory(item.task_id, item.group_id, item.sample, [seg], reward), None))


def test_edge_curriculum_gives_more_groups_a_learning_signal_than_uniform(tmp_path):
    tasks = [f"easy{i}" for i in range(6)] + [f"hard{i}" for i in range(6)] + ["edge0", "edge1"]
    levels = {t: {"easy": 1, "edge": 2, "hard": 3}[t.rstrip("0123456789")] for t in tasks}
    mixed = {}
    for curriculum in ("uniform", "edge"):
        out = tmp_path / curriculum
        cfg = config(out, steps=20, curriculum=curriculum, curriculum_explore=0.1)
        rt = Skilled(seed=0)
        Orchestrator(cfg, rt, tasks, "sync", out / "rl", difficulties=levels).run()
        rt.close()
        metrics = rows(out / "rl")
        mixed[curriculum] = sum(r["mixed_groups"] for r in metrics) / len(metrics)
        assert {k for r in metrics for k in r if k.startswith("solve_rate_d")} <= {
            f"solve_rate_d{d}" for d in (1, 2, 3)
        }
    assert mixed["edge"] > 2 * mixed["uniform"], mixed
    assert "curriculum_edge_tasks" in metrics[-1]
