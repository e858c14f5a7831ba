"""Kept rollouts: what the policy did, step by step, readable after the run (`strop runs show`).

RL writes each step's trajectories to `<stage>/rollouts/step_000037.jsonl.gz` and evaluation
to `eval_greedy.jsonl.gz` / `eval_sampled.jsonl.gz`: one gzipped JSON record a line (gzip so that
`zcat` and `zless` read them too). A record is a trajectory without its token arrays: the messages
of each context window (tool calls and observations included), the reward and its breakdown, the
advantage it was trained with, hack flags, the policy versions its tokens came from, stop reason,
timings and behaviour. The token data stays in the trainer's hands; these files are for reading.

The directory holds at most `log.rollouts_max_mb`: a step that would pass the cap keeps only its
best and worst trajectory, and once even those would pass it, steps keep nothing (said once).
"""

import gzip
import json
import re
from pathlib import Path

from strop.rl.trajectory import Trajectory
from strop.tracking import NullTracker, Tracker

SCHEMA_VERSION = 1
STEP_FILE = re.compile(r"step_(\d+)\.jsonl\.gz")


def record(traj: Trajectory, advantage: float | None = None, step: int | None = None) -> dict:
    """The readable record of one trajectory (module docstring)."""
    versions = [v for s in traj.segments for v, m in zip(s.versions, s.loss_mask) if m]
    return {
        "schema_version": SCHEMA_VERSION,
        "step": step,
        "task_id": traj.task_id,
        "group_id": traj.group_id,
        "sample": traj.sample,
        "reward": traj.reward,
        "advantage": advantage,
        "breakdown": traj.breakdown,
        "hack_flags": traj.hack_flags,
        "stop_reason": traj.stop_reason,
        "versions": [min(versions), max(versions)] if versions else [traj.start_version, traj.start_version],
        "start_version": traj.start_version,
        "generated_tokens": traj.generated_tokens,
        "timings": traj.timings,
        "behaviour": traj.behaviour,
        "segments": [
            {"messages": s.messages, "tokens": len(s.input_ids), "generated": sum(s.loss_mask)} for s in traj.segments
        ],
    }


def best_and_worst(records: list[dict]) -> list[dict]:
    """The best record (highest reward, then advantage) and the worst (lowest): two distinct records
    whenever there are two, even when every reward ties."""
    ranked = sorted(records, key=lambda r: (r["reward"], r["advantage"] if r["advantage"] is not None else 0.0))
    return [ranked[-1], ranked[0]] if len(ranked) > 1 else ranked


class RolloutLog:
    """One rollouts/ directory under its size cap (module docstring)."""

    def __init__(self, directory: str | Path, max_mb: float, tracker: Tracker | None = None):
        self.dir = Path(directory)
        self.max_bytes = int(max_mb * 1e6)
        self.tracker = tracker or NullTracker()
        self.warned = False

    def used_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.dir.glob("*.jsonl.gz")) if self.dir.is_dir() else 0

    def write(self, name: str, records: list[dict]) -> int:
        """Writes `<name>.jsonl.gz` (replacing one a resumed run left) within the cap; returns how many
        records it kept."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{name}.jsonl.gz"
        if path.exists():
            path.unlink()
        room = self.max_bytes - self.used_bytes()
        for kept in (records, best_and_worst(records)):
            data = gzip.compress("".join(json.dumps(r) + "\n" for r in kept).encode(), compresslevel=6, mtime=0)
            if len(data) <= room:
                tmp = path.with_suffix(".tmp")
                tmp.write_bytes(data)
                tmp.replace(path)
                return len(kept)
        if not self.warned:
            print(
                f"[rollouts] {self.dir} reached its cap of {self.max_bytes / 1e6:g} MB: later steps keep none",
                flush=True,
            )
            self.warned = True
        return 0

    def write_step(self, step: int, records: list[dict]) -> int:
        """One RL step's records; W&B also gets its best and worst (`log.trajectories_every`)."""
        kept = self.write(f"step_{step:06d}", records)
        self.tracker.trajectories(step, best_and_worst(records))
        return kept

    def truncate_after(self, step: int) -> None:
        """Drops the steps a killed run wrote after its last checkpoint (they will be redone)."""
        for n, path in self.steps().items():
            if n > step:
                path.unlink()

    def steps(self) -> dict[int, Path]:
        found = {}
        for p in self.dir.glob("step_*.jsonl.gz") if self.dir.is_dir() else ():
            m = STEP_FILE.fullmatch(p.name)
            if m:
                found[int(m.group(1))] = p
        return dict(sorted(found.items()))


def read(path: str | Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]
