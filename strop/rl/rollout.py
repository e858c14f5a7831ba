"""Rollout: one task, one policy, one sandboxed episode -> one scored `Trajectory`.

A rollout worker is handed a `WorkItem` (task, group, sample index, seed, the version it was
admitted under) and a `PolicyClient`. It runs the production harness against that client in a
fresh sandbox (`run_task`), scores the workspace changes with the checker in another fresh
sandbox, runs the hack monitor, and returns the `Trajectory` with the reward breakdown and the
hack flags. The G samples of a group are G work items with the same `group_id`; the buffer puts
them back together.

An episode whose policy failed (`stop_reason == "policy_error"`: the engine died or was taken
away mid-episode) is not a sample of the policy's behaviour but of the infrastructure, so it
raises `RolloutLost` and the runtime relaunches the item on another engine.

Plain data in and out, so a worker can live in a thread or a Ray actor.
"""

import time
from dataclasses import asdict, dataclass, replace

from strop.config import RolloutSection
from strop.env.grading.checker import Score, check, source_changes, task_limits
from strop.env.grading.hack_monitor import detect
from strop.env.harness.loop import Harness, run_task
from strop.env.sandbox.interface import Limits
from strop.env.task import Task
from strop.policy_api import PolicyClient
from strop.rl.trajectory import Trajectory


class RolloutLost(RuntimeError):
    """The episode was cut short by the infrastructure (engine gone), not by the policy."""


@dataclass(frozen=True)
class WorkItem:
    task_id: str
    group_id: str
    sample: int  # index within the group
    seed: int  # sampling seed of the episode: a relaunch samples the same way
    version: int  # policy version the item was admitted under (Trajectory.start_version)
    attempt: int = 0  # relaunches so far

    @property
    def key(self) -> tuple[str, int]:
        return self.group_id, self.sample

    def to_dict(self) -> dict:
        return asdict(self)


def sandbox_limits(r: RolloutSection) -> Limits:
    """A run's sandbox limits (`rollout.command_timeout_s`, `rollout.memory_mb`, ...)."""
    return Limits(
        timeout_s=r.command_timeout_s,
        cpu_s=r.cpu_s,
        memory_mb=r.memory_mb,
        max_procs=r.max_procs,
        file_size_mb=r.file_size_mb,
        workspace_mb=r.workspace_mb,
    )


def _final_message(messages: list[dict]) -> str | None:
    return next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), None)


def score_changes(task: Task, changes: dict, limits: Limits = Limits()) -> Score:
    """The checker's score, "binary" unless the task's suite scores it otherwise
    (`metadata["reward_mode"]`), its test run under `limits` (the run's) as the task amends them.
    Every task starts from a repository that fails its hidden tests (that is what makes it a task),
    so an episode that changed nothing scores 0 without a test run."""
    if not changes:
        return Score(0.0, reason="no changes", outcome="no changes")
    return check(task, changes, mode=task.metadata.get("reward_mode", "binary"), limits=task_limits(task, limits))


def rollout(
    task: Task, policy: PolicyClient, harness: Harness, item: WorkItem, limits: Limits = Limits()
) -> Trajectory:
    """One episode of `task` scored and flagged; raises `RolloutLost` when the policy failed.
    Its timings add to the harness's (policy_s, tools_s, total_s) `sandbox_s` (the episode's
    sandbox: start, diff, close) and `monitor_s` (the hack monitor); the checker's is `check_s`."""
    # the task's own memory and CPU limits hold in its episodes too: the agent can run what the checker runs
    own = replace(task_limits(task, limits), timeout_s=limits.timeout_s)
    t0 = time.perf_counter()
    episode, changes = run_task(harness, policy, task, own, seed=item.seed)
    sandbox_s = time.perf_counter() - t0 - episode.timings["total_s"]
    changes = source_changes(changes)
    if episode.stop_reason == "policy_error":
        raise RolloutLost(f"{item.key}: {episode.detail}")
    score = score_changes(task, changes, limits)
    t1 = time.perf_counter()
    flags = detect(task, changes, episode.tool_calls, score, _final_message(episode.messages))
    episode.timings.update(sandbox_s=sandbox_s, monitor_s=time.perf_counter() - t1)
    return Trajectory.from_episode(
        episode,
        task_id=task.id,
        group_id=item.group_id,
        sample=item.sample,
        score=score,
        hack_flags=flags,
        start_version=item.version,
        facts=task.metadata.get("facts", ()),
    )
