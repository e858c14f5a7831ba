"""The staleness-bounded buffer: admission control, group release, the per-sample bound (asserted
where batches are handed out), drop accounting, thread safety and exact snapshot/restore."""

import json
import random
import threading

import pytest

from strop.env.episode import Segment
from strop.rl.buffer import StalenessBuffer
from strop.rl.trajectory import Trajectory


def traj(group: str, sample: int, version: int, reward: float = 0.0) -> Trajectory:
    seg = Segment()
    seg.add_forced([1])
    seg.add_generated([2, 3], [-0.1, -0.2], [version, version + 1], None)
    return Trajectory(f"task-{group}", group, sample, [seg], reward, start_version=version)


def fill(buf: StalenessBuffer, group: str, version: int, n: int | None = None) -> None:
    for s in range(n if n is not None else buf.group_size):
        assert buf.admit(version)
        buf.put(traj(group, s, version))


def test_admission_bounds_inflight_plus_buffered():
    buf = StalenessBuffer(group_size=2, max_staleness=1, capacity=4)
    assert buf.admit(0, n=2) and buf.admit(0) and buf.admit(0)
    assert not buf.admit(0)  # 4 running
    buf.put(traj("a", 0, 0))
    buf.put(traj("a", 1, 0))
    assert not buf.admit(0)  # 2 running + 2 buffered
    assert [g.group_id for g in buf.get(1)] == ["a"]  # handing out frees room
    assert buf.admit(0, n=2) and not buf.admit(0)
    s = buf.stats()
    assert s["inflight"] == 4 and s["admitted"] == 6 and s["refused"] == 3 and s["released"] == 2


def test_admission_refuses_work_past_the_bound():
    buf = StalenessBuffer(group_size=2, max_staleness=1, capacity=8, version=3)
    assert not buf.admit(1) and buf.admit(2)


def test_groups_release_as_they_complete_oldest_first():
    buf = StalenessBuffer(group_size=2, max_staleness=3, capacity=8, version=2)
    fill(buf, "new", 2)
    fill(buf, "partial", 0, n=1)
    assert buf.get(2, timeout=0.01) == []  # "partial" is not complete
    fill(buf, "old", 0)
    assert [g.group_id for g in buf.get(2)] == ["old", "new"]
    assert buf.missing() == [("partial", "task-partial", 1)]


def test_stale_samples_are_dropped_and_never_handed_out():
    buf = StalenessBuffer(group_size=2, max_staleness=1, capacity=8)
    fill(buf, "a", 0)  # ready
    assert buf.admit(0, n=2)
    buf.put(traj("b", 0, 0))  # pending
    buf.set_version(2)  # both groups are now 2 versions behind
    assert buf.put(traj("b", 1, 0)) is False  # stale on arrival
    fill(buf, "c", 1)
    assert [g.group_id for g in buf.get(1)] == ["c"]
    s = buf.stats()
    assert s["dropped"] == {"stale": 4} and s["buffered"] == 0 and s["ready_groups"] == 0


def test_handing_out_asserts_the_bound(monkeypatch):
    buf = StalenessBuffer(group_size=2, max_staleness=0, capacity=4)
    fill(buf, "a", 0)
    monkeypatch.setattr(buf, "_stale", lambda t: False)  # break eviction: the hand-out check must catch it
    buf.set_version(1)
    with pytest.raises(AssertionError, match="staleness bound violated"):
        buf.get(1)


def test_cancelled_samples_let_groups_complete():
    buf = StalenessBuffer(group_size=3, max_staleness=1, capacity=6)
    assert buf.admit(0, n=6)
    buf.put(traj("a", 0, 0))
    buf.put(traj("a", 1, 0))
    buf.cancel("a", 2, "worker_lost")
    buf.put(traj("b", 0, 0))
    buf.cancel("b", 1, "error")
    buf.cancel("b", 2, "error")  # one survivor: no baseline
    [g] = buf.get(1)
    assert g.group_id == "a" and len(g.trajectories) == 2 and g.size == 3
    assert buf.stats()["dropped"] == {"worker_lost": 1, "error": 2, "group_too_small": 1}
    assert buf.stats()["inflight"] == 0 and buf.get(1, timeout=0.01) == []


def test_duplicates_are_never_trained_twice():
    buf = StalenessBuffer(group_size=2, max_staleness=1, capacity=8)
    assert buf.admit(0, n=4)
    assert buf.put(traj("a", 0, 0)) and not buf.put(traj("a", 0, 0))  # retried elsewhere, both finished
    buf.put(traj("a", 1, 0))
    buf.get(1)
    assert not buf.put(traj("a", 1, 0))  # after release too
    assert buf.stats()["dropped"] == {"duplicate": 2} and buf.stats()["inflight"] == 0


def test_admit_waits_for_room():
    buf = StalenessBuffer(group_size=2, max_staleness=1, capacity=2)
    fill(buf, "a", 0)
    threading.Timer(0.05, lambda: buf.get(1)).start()
    assert not buf.admit(0, timeout=0.0)
    assert buf.admit(0, timeout=5.0)


def test_threads_never_lose_or_duplicate_and_respect_the_bound():
    """Producers at a lagging engine version race a trainer that bumps the version every batch."""
    G, B, S = 4, 2, 1
    buf = StalenessBuffer(group_size=G, max_staleness=S, capacity=B * G * (S + 1))
    stop = threading.Event()
    lock = threading.Lock()
    next_group = [0]

    def producer(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            version = max(0, buf.version - rng.choice([0, 0, 1, 2]))  # sometimes an engine lags behind
            if not buf.admit(version, n=G, timeout=0.01):
                continue
            with lock:
                gid, next_group[0] = f"g{next_group[0]}", next_group[0] + 1
            for s in range(G):
                if rng.random() < 0.05:
                    buf.cancel(gid, s, "error")
                else:
                    buf.put(traj(gid, s, version))

    threads = [threading.Thread(target=producer, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    seen = set()
    for step in range(30):
        batch = buf.get(B, timeout=10)
        assert len(batch) == B
        for g in batch:
            for t in g.trajectories:
                assert t.key not in seen
                seen.add(t.key)
                assert step - t.min_version <= S
        buf.set_version(step + 1)
    stop.set()
    for t in threads:
        t.join()
    s = buf.stats()
    dropped = sum(s["dropped"].values())
    assert (
        s["admitted"] == s["released"] + dropped + s["inflight"] + s["buffered"] == len(seen) + dropped + s["buffered"]
    )


def test_snapshot_restore_is_exact():
    buf = StalenessBuffer(group_size=2, max_staleness=2, capacity=8, version=1)
    fill(buf, "a", 1)
    fill(buf, "b", 0, n=1)
    assert buf.admit(1)  # in flight at the snapshot: not part of it
    buf.cancel("c", 0, "error")
    state = json.loads(json.dumps(buf.state_dict()))

    other = StalenessBuffer(group_size=2, max_staleness=2, capacity=8)
    other.load_state_dict(state)
    assert other.state_dict() == buf.state_dict()
    assert other.stats() == {**buf.stats(), "inflight": 0}
    assert other.missing() == buf.missing() == [("b", "task-b", 1), ("c", "", 1)]
    assert [g.to_dict() for g in other.get(1)] == [g.to_dict() for g in buf.get(1)]
    assert other.admit(0) and not other.put(traj("a", 0, 1))  # released before: duplicate
