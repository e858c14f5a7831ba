"""A curriculum at the policy's edge: RL draws the tasks whose running solve rate is neither 0 nor 1.

A group whose samples all pass, or all fail, has advantage 0 everywhere and teaches nothing; the
tasks worth drawing are those the current policy solves sometimes. `EdgeSampler` (`rl.curriculum =
"edge"`; "uniform", the default, is `strop.rl.orchestrator.TaskSampler`) keeps an estimate per task
and per difficulty, updated from every group trained on (an exponential moving average of the
group's solved fraction, the newest group weighing `rl.curriculum_memory`), and draws:

- with probability `rl.curriculum_explore`, and whenever nothing is known to be at the edge, a task
  never drawn yet (a floor of exploration: a task's estimate starts only once it was tried);
- else a task whose estimate is strictly between 0 and 1, weighted by p(1 - p) (most at 1/2);
- when no task is there, a task of a difficulty whose estimate is (the policy may have moved since
  its tasks were last seen), and failing that any task.

Each draw uses its own seeded generator (seed, position), so a run that resumes with the same
estimates draws the same tasks; in `sync` mode the whole sequence is fixed by the seed. The state
(`state_dict`) is plain data, kept in the RL checkpoint.
"""

from random import Random

EPS = 1e-9


class EdgeSampler:
    """Draws task ids at the policy's edge (see the module docstring); same interface as
    `strop.rl.orchestrator.TaskSampler`: `next()`, `observe(groups)`, `state_dict()`."""

    def __init__(self, task_ids: list[str], difficulties: dict[str, int], seed: int, explore: float, memory: float):
        assert task_ids, "no tasks to sample"
        self.task_ids, self.seed, self.explore, self.memory = sorted(task_ids), seed, explore, memory
        self.difficulty = {t: int(difficulties.get(t, 0)) for t in self.task_ids}
        self.position = 0
        self.rate: dict[str, float] = {}  # task id -> running solve rate
        self.by_difficulty: dict[int, float] = {}

    def _update(self, table: dict, key, solved: float) -> None:
        table[key] = solved if key not in table else (1 - self.memory) * table[key] + self.memory * solved

    def observe(self, groups) -> None:
        """Fold trained groups (`strop.rl.trajectory.TrajectoryGroup`) into the estimates."""
        for g in groups:
            if g.task_id not in self.difficulty or not g.trajectories:
                continue
            solved = sum(t.solved for t in g.trajectories) / len(g.trajectories)
            self._update(self.rate, g.task_id, solved)
            self._update(self.by_difficulty, self.difficulty[g.task_id], solved)

    def at_edge(self) -> list[str]:
        return [t for t in self.task_ids if EPS < self.rate.get(t, 0.0) < 1 - EPS]

    def next(self) -> tuple[int, str]:
        rng = Random(f"{self.seed}/edge/{self.position}")
        unseen = [t for t in self.task_ids if t not in self.rate]
        edge = self.at_edge()
        if unseen and (not edge or rng.random() < self.explore):
            chosen = rng.choice(unseen)
        elif edge:
            chosen = rng.choices(edge, weights=[self.rate[t] * (1 - self.rate[t]) for t in edge])[0]
        else:
            levels = {d for d, p in self.by_difficulty.items() if EPS < p < 1 - EPS}
            pool = [t for t in self.task_ids if self.difficulty[t] in levels] or self.task_ids
            chosen = rng.choice(pool)
        drawn = self.position, chosen
        self.position += 1
        return drawn

    def figures(self) -> dict:
        """What a metrics row says of the curriculum: tasks at the edge, tasks never drawn."""
        return {
            "curriculum_edge_tasks": len(self.at_edge()),
            "curriculum_unseen_tasks": len(self.task_ids) - len(self.rate),
        }

    def state_dict(self) -> dict:
        return {
            "position": self.position,
            "rate": dict(self.rate),
            "by_difficulty": {str(d): p for d, p in self.by_difficulty.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]
        self.rate = {t: p for t, p in state.get("rate", {}).items() if t in self.difficulty}
        self.by_difficulty = {int(d): p for d, p in state.get("by_difficulty", {}).items()}


def solve_by_difficulty(groups, difficulties: dict[str, int]) -> dict[str, float]:
    """The solved fraction of a step's samples per difficulty: {"solve_rate_d<N>": fraction}."""
    solved: dict[int, list[bool]] = {}
    for g in groups:
        solved.setdefault(int(difficulties.get(g.task_id, 0)), []).extend(t.solved for t in g.trajectories)
    return {f"solve_rate_d{d}": sum(s) / len(s) for d, s in sorted(solved.items()) if s}
