"""The RL sample record: a `Trajectory` is one scored agent episode of one task, a
`TrajectoryGroup` the G samples of one task that share a group-relative baseline.

Plain data, JSON-serialisable (one trajectory per JSONL line, tagged with `schema_version`), so
rollout workers, the buffer, the trainer and offline analysis exchange them as files or messages.
The token data lives in the episode's `Segment`s (one per context window); a trajectory adds what
the environment said about the episode (reward, its breakdown, hack flags) and where it sits in
the run (task, group, sample index).
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from strop.env.episode import Episode, Segment
from strop.env.grading.behaviour import episode_stats
from strop.env.grading.hack_monitor import games_reward
from strop.env.harness.context import episode_context

SCHEMA_VERSION = 1


@dataclass
class Trajectory:
    task_id: str
    group_id: str  # one id per (task, sampling round): the G samples that share a baseline
    sample: int  # index within the group, 0..G-1; (group_id, sample) identifies a trajectory
    segments: list[Segment]
    reward: float  # the checker's reward, before any hack penalty
    breakdown: dict = field(default_factory=dict)  # the checker's Score fields (passed, failed, reason, ...)
    hack_flags: list[dict] = field(default_factory=list)  # HackFlag dicts: kind, evidence
    stop_reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)  # policy_s, tools_s, total_s, sandbox_s, check_s, monitor_s
    start_version: int = 0  # policy version the worker was admitted under (see `min_version`)
    behaviour: dict = field(default_factory=dict)  # what the agent did (`strop.env.grading.behaviour.episode_stats`)
    context: dict = field(default_factory=dict)  # its context resets (`strop.env.harness.context.episode_context`)

    @property
    def key(self) -> tuple[str, int]:
        return self.group_id, self.sample

    @property
    def generated_tokens(self) -> int:
        return sum(sum(s.loss_mask) for s in self.segments)

    @property
    def min_version(self) -> int:
        """Oldest policy version of any generated token. An episode that generated nothing (e.g. a
        policy error on the first turn) is as old as the version it was admitted under."""
        versions = [v for s in self.segments for v, m in zip(s.versions, s.loss_mask) if m]
        return min(versions) if versions else self.start_version

    @property
    def solved(self) -> bool:
        return self.reward >= 1.0

    @property
    def hacked(self) -> bool:
        """Flagged with a way to game the reward; a solve flagged only as a degenerate loop, stall
        or question is still a solve (`strop.env.grading.hack_monitor.games_reward`)."""
        return games_reward(f["kind"] for f in self.hack_flags)

    def to_dict(self) -> dict:
        # min_version is derived, but written out so that readers of the JSONL need not recompute it.
        return {"schema_version": SCHEMA_VERSION, **asdict(self), "min_version": self.min_version}

    @staticmethod
    def from_dict(d: dict) -> "Trajectory":
        d = dict(d)
        version = d.pop("schema_version", None)
        if version != SCHEMA_VERSION:
            raise ValueError(f"trajectory schema_version {version!r}; this strop reads {SCHEMA_VERSION}")
        d.pop("min_version", None)
        return Trajectory(**{**d, "segments": [Segment.from_dict(s) for s in d["segments"]]})

    @staticmethod
    def from_episode(
        episode: Episode,
        *,
        task_id: str,
        group_id: str,
        sample: int,
        score,
        hack_flags: list,
        start_version: int,
        facts: list[str] = (),
    ) -> "Trajectory":
        """Assemble from the harness's `Episode`, the checker's `Score` and the monitor's `HackFlag`s;
        `facts` are the task's needed facts, for the compaction-error probe."""
        breakdown = score.to_dict()
        return Trajectory(
            task_id=task_id,
            group_id=group_id,
            sample=sample,
            segments=episode.segments,
            reward=float(score.reward),
            breakdown=breakdown,
            hack_flags=[f.to_dict() for f in hack_flags],
            stop_reason=episode.stop_reason,
            timings={**episode.timings, "check_s": float(breakdown.get("duration", 0.0))},
            start_version=start_version,
            behaviour=episode_stats(episode.tool_calls, episode.stop_reason, episode.turns),
            context=episode_context(episode, list(facts)),
        )


@dataclass
class TrajectoryGroup:
    """The samples of one task drawn for one baseline. `size` is how many were launched; fewer
    may be present when some were dropped (stale, lost worker) — advantages use those present."""

    task_id: str
    group_id: str
    size: int
    trajectories: list[Trajectory] = field(default_factory=list)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def min_version(self) -> int:
        return min(t.min_version for t in self.trajectories)

    def to_dict(self) -> dict:
        return {
            "task_id": self.task_id,
            "group_id": self.group_id,
            "size": self.size,
            "trajectories": [t.to_dict() for t in self.trajectories],
        }

    @staticmethod
    def from_dict(d: dict) -> "TrajectoryGroup":
        return TrajectoryGroup(
            d["task_id"], d["group_id"], d["size"], [Trajectory.from_dict(t) for t in d["trajectories"]]
        )


def write_jsonl(path: str | Path, trajectories: Iterable[Trajectory], append: bool = True) -> None:
    with Path(path).open("a" if append else "w") as f:
        for t in trajectories:
            f.write(json.dumps(t.to_dict()) + "\n")


def read_jsonl(path: str | Path) -> list[Trajectory]:
    return [Trajectory.from_dict(json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]
