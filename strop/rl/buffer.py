"""The staleness-bounded buffer between rollout producers and the trainer.

The bound is per sample: a trajectory whose oldest generated token is more than `max_staleness`
policy versions behind the trainer is never handed out (asserted in `get`). Rather than throwing
such work away after the fact, producers are paced: a worker calls `admit(version)` before it
starts an episode, and admission is refused while admitted-but-untrained work (running plus
buffered) fills `capacity`. With the trainer taking B groups of G samples per step, a capacity of
B*G*(max_staleness+1) keeps everything admitted at the current version trainable, so drops only
come from slow stragglers and lagging engines. Every dropped sample is counted by reason.

Groups are released to the trainer as soon as all G samples are accounted for (arrived, or given
up on through `cancel`); the oldest groups go first, as they are the closest to the bound. A group
needs at least `min_group` surviving samples for a group-relative baseline; smaller ones are
dropped ("group_too_small").

A trajectory is identified by (group_id, sample): a second delivery (a retried episode whose
first worker was not dead after all) is dropped as "duplicate", so nothing is trained on twice.

Thread-safe: one lock and condition guard everything, so a main loop, worker threads and Ray
actor callbacks may call in concurrently. `state_dict()` snapshots the contents for exact resume;
reservations of work in flight are not part of it (that work dies with its process) —
`missing()` lists the samples a resumed run must relaunch or cancel.
"""

import threading
from collections import Counter
from dataclasses import dataclass, field

from strop.rl.trajectory import Trajectory, TrajectoryGroup


@dataclass
class _Pending:
    task_id: str
    trajectories: dict[int, Trajectory] = field(default_factory=dict)  # sample index -> trajectory
    accounted: set[int] = field(default_factory=set)  # samples that arrived or were given up on


class StalenessBuffer:
    def __init__(self, group_size: int, max_staleness: int, capacity: int, *, version: int = 0, min_group: int = 2):
        if capacity < group_size:
            raise ValueError(f"buffer capacity {capacity} is below one group ({group_size} samples)")
        self.group_size = group_size
        self.max_staleness = max_staleness
        self.capacity = capacity
        self.min_group = min_group
        self._version = version
        self._cond = threading.Condition()
        self._inflight = 0  # admitted samples not yet delivered or cancelled
        self._pending: dict[str, _Pending] = {}
        self._ready: list[TrajectoryGroup] = []
        self._done: set[str] = set()  # group ids released or dropped whole: later deliveries are duplicates
        self._counts: Counter = Counter()  # admitted, refused, received, released
        self._dropped: Counter = Counter()  # samples by reason

    # ---- producers -------------------------------------------------------------------------

    def admit(self, version: int, n: int = 1, timeout: float = 0.0) -> bool:
        """Reserve room for `n` samples generated from policy `version`, waiting up to `timeout`
        seconds for room. False when there is none, or when `version` is already past the bound."""
        with self._cond:
            # Versions only move forward: work already past the bound can never become admissible.
            stale = self._version - version > self.max_staleness
            ok = not stale and self._cond.wait_for(lambda: self._room(version, n), timeout=timeout)
            if ok:
                self._inflight += n
                self._counts["admitted"] += n
            else:
                self._counts["refused"] += n
            return ok

    def put(self, traj: Trajectory) -> bool:
        """Deliver an admitted sample; releases its reservation. True when it was kept."""
        with self._cond:
            assert self._inflight > 0, "put without a matching admit"
            self._inflight -= 1
            self._counts["received"] += 1
            group = self._pending.get(traj.group_id)
            if traj.group_id in self._done or (group is not None and traj.sample in group.accounted):
                self._dropped["duplicate"] += 1
                self._cond.notify_all()
                return False
            assert 0 <= traj.sample < self.group_size, (
                f"sample index {traj.sample} outside a group of {self.group_size}"
            )
            group = self._pending.setdefault(traj.group_id, _Pending(traj.task_id))
            group.task_id = traj.task_id
            group.accounted.add(traj.sample)
            kept = not self._stale(traj)
            if kept:
                group.trajectories[traj.sample] = traj
            else:
                self._dropped["stale"] += 1
            self._complete(traj.group_id)
            self._cond.notify_all()
            return kept

    def cancel(self, group_id: str, sample: int, reason: str) -> None:
        """Give up on an admitted sample that will not be delivered (lost worker, harness error);
        releases its reservation and lets its group complete without it."""
        with self._cond:
            assert self._inflight > 0, "cancel without a matching admit"
            self._inflight -= 1
            self._dropped[reason] += 1
            if group_id not in self._done:
                self._pending.setdefault(group_id, _Pending("")).accounted.add(sample)
                self._complete(group_id)
            self._cond.notify_all()

    # ---- the trainer -----------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """The trainer moved to `version`: evict what that made too stale, and wake producers."""
        with self._cond:
            assert version >= self._version, f"version went back from {self._version} to {version}"
            self._version = version
            for group_id, group in list(self._pending.items()):
                for s, t in list(group.trajectories.items()):
                    if self._stale(t):
                        del group.trajectories[s]
                        self._dropped["stale"] += 1
            ready = []
            for g in self._ready:
                fresh = [t for t in g.trajectories if not self._stale(t)]
                self._drop("stale", len(g.trajectories) - len(fresh))
                if len(fresh) >= self.min_group:
                    ready.append(TrajectoryGroup(g.task_id, g.group_id, g.size, fresh))
                else:
                    self._drop("group_too_small", len(fresh))
            self._ready = ready
            self._cond.notify_all()

    def get(self, n_groups: int, timeout: float | None = None) -> list[TrajectoryGroup]:
        """The `n_groups` oldest complete groups, waiting up to `timeout` seconds (None: forever)
        for that many; [] on timeout. Every sample handed out is within the staleness bound."""
        assert n_groups * self.group_size <= self.capacity, (
            f"a batch of {n_groups} groups of {self.group_size} can never fit a capacity of {self.capacity}"
        )
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._ready) >= n_groups, timeout=timeout):
                return []
            self._ready.sort(key=lambda g: g.min_version)  # stable: ties keep completion order
            batch, self._ready = self._ready[:n_groups], self._ready[n_groups:]
            for g in batch:
                for t in g.trajectories:
                    assert self._version - t.min_version <= self.max_staleness, (
                        f"staleness bound violated: {t.key} min_version {t.min_version} at trainer version "
                        f"{self._version} (max_staleness {self.max_staleness})"
                    )
                self._counts["released"] += len(g.trajectories)
            self._cond.notify_all()
            return batch

    # ---- inspection and resume -------------------------------------------------------------

    def stats(self) -> dict:
        with self._cond:
            return {
                "version": self._version,
                "inflight": self._inflight,
                "buffered": self._buffered(),
                "ready_groups": len(self._ready),
                **{k: self._counts[k] for k in ("admitted", "refused", "received", "released")},
                "dropped": dict(self._dropped),
            }

    def missing(self) -> list[tuple[str, str, int]]:
        """(group_id, task_id, sample) of every sample of a started group not yet accounted for."""
        with self._cond:
            return [
                (gid, g.task_id, s)
                for gid, g in self._pending.items()
                for s in range(self.group_size)
                if s not in g.accounted
            ]

    def state_dict(self) -> dict:
        """Plain data (JSON-serialisable): version, buffered samples, counters. Not the
        reservations of work in flight."""
        with self._cond:
            return {
                "version": self._version,
                "pending": [
                    {
                        "group_id": gid,
                        "task_id": g.task_id,
                        "accounted": sorted(g.accounted),
                        "trajectories": [t.to_dict() for _, t in sorted(g.trajectories.items())],
                    }
                    for gid, g in self._pending.items()
                ],
                "ready": [g.to_dict() for g in self._ready],
                "done": sorted(self._done),
                "counts": dict(self._counts),
                "dropped": dict(self._dropped),
            }

    def load_state_dict(self, state: dict) -> None:
        with self._cond:
            self._version = state["version"]
            self._inflight = 0
            self._pending = {}
            for p in state["pending"]:
                trajs = [Trajectory.from_dict(t) for t in p["trajectories"]]
                self._pending[p["group_id"]] = _Pending(p["task_id"], {t.sample: t for t in trajs}, set(p["accounted"]))
            self._ready = [TrajectoryGroup.from_dict(g) for g in state["ready"]]
            self._done = set(state["done"])
            self._counts = Counter(state["counts"])
            self._dropped = Counter(state["dropped"])
            self._cond.notify_all()

    # ---- internals (lock held) -------------------------------------------------------------

    def _stale(self, traj: Trajectory) -> bool:
        return self._version - traj.min_version > self.max_staleness

    def _buffered(self) -> int:
        return sum(len(g.trajectories) for g in self._pending.values()) + sum(len(g.trajectories) for g in self._ready)

    def _room(self, version: int, n: int) -> bool:
        return self._version - version <= self.max_staleness and self._inflight + self._buffered() + n <= self.capacity

    def _complete(self, group_id: str) -> None:
        """Release or drop the group once every sample is accounted for."""
        group = self._pending[group_id]
        if len(group.accounted) < self.group_size:
            return
        del self._pending[group_id]
        self._done.add(group_id)
        trajs = [t for _, t in sorted(group.trajectories.items())]
        if len(trajs) >= self.min_group:
            self._ready.append(TrajectoryGroup(group.task_id, group_id, self.group_size, trajs))
        else:
            self._drop("group_too_small", len(trajs))

    def _drop(self, reason: str, n: int) -> None:
        if n:  # only reasons that happened appear in stats
            self._dropped[reason] += n
