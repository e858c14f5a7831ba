"""The orchestrator's main loop on a simulated runtime (rollouts on threads with random durations,
a trainer that only counts): the per-sample staleness bound holds, sync drains between steps,
lost rollouts are relaunched so nothing is lost or trained twice, hack flags are penalised and
counted, and a killed run resumes from its checkpoint exactly where it was."""

import json
import queue
import random
import threading
import time

import pytest

from strop.config import load_config
from strop.env.episode import Segment
from strop.rl.orchestrator import Orchestrator, TaskSampler
from strop.rl.rollout import WorkItem
from strop.rl.trajectory import Trajectory
from strop.runtime.inline import drain


class SimRuntime:
    """Plays the runtime's part: each submitted item 'generates' for a random time on the newest
    version the engines hold, reading that version at the start and end of the episode (the weights
    can change mid-episode). Items listed in `lose` fail on their first attempt (a dead engine); sample 0 of a
    task in `hacked_tasks` is hack-flagged."""

    def __init__(
        self,
        seed: int = 0,
        lose: frozenset = frozenset(),
        hacked_tasks: frozenset = frozenset(),
        rollout_s: float = 0.004,
        train_s: float = 0.002,
    ):
        self._version, self.bytes_synced = 0, 0
        self.rng = random.Random(seed)
        self.lose, self.hacked_tasks = lose, hacked_tasks
        self.rollout_s, self.train_s = rollout_s, train_s
        self.done: queue.Queue = queue.Queue()
        self.trained: list[tuple[str, int]] = []
        self.samples: list = []
        self.steps_seen: list[dict] = []
        self.threads: list[threading.Thread] = []

    def submit(self, item: WorkItem) -> None:
        delay = self.rng.uniform(0.2, 3.0) * self.rollout_s
        t = threading.Thread(target=self._run, args=(item, delay), daemon=True)
        t.start()
        self.threads.append(t)

    def _run(self, item: WorkItem, delay: float) -> None:
        first = self._version
        time.sleep(delay)
        if item.key in self.lose and item.attempt == 0:
            self.done.put((item, None, "engine died"))
            return
        seg = Segment()
        seg.add_forced([1, 2])
        seg.add_generated([3, 4], [-0.5, -0.5], [first, self._version], None)
        hacked = item.task_id in self.hacked_tasks and item.sample == 0
        reward = float(hash((item.group_id, item.sample)) % 2)
        self.done.put(
            (
                item,
                Trajectory(
                    item.task_id,
                    item.group_id,
                    item.sample,
                    [seg],
                    reward,
                    hack_flags=[{"kind": "test_edit", "evidence": "x"}] if hacked else [],
                    start_version=item.version,
                ),
                None,
            )
        )

    def results(self, timeout: float):
        return drain(self.done, timeout)

    def train(self, samples) -> dict:
        time.sleep(self.train_s)
        keys = [s.trajectory.key for s in samples]
        self.trained += keys
        self.samples += samples
        staleness = [self._version - s.trajectory.min_version for s in samples]
        self._version += 1
        self.bytes_synced += 100
        return {
            "version": self._version,
            "reward": 0.0,
            "solve_rate": 0.0,
            "hacked": sum(bool(s.trajectory.hack_flags) for s in samples),
            "staleness_max": max(staleness),
            "k3": 0.0,
            "clip_frac": 0.0,
        }

    def wait_synced(self) -> None:
        pass

    @property
    def version(self) -> int:
        return self._version

    def save(self, path) -> None:
        (path / "sim.json").write_text(json.dumps({"version": self._version, "trained": list(self.trained)}))

    def load(self, path) -> None:
        state = json.loads((path / "sim.json").read_text())
        self._version, self.trained = state["version"], [tuple(k) for k in state["trained"]]

    def engine_stats(self) -> dict:
        return {"busy_s": 0.0, "engines": 1}

    def cpu_seconds(self) -> dict:
        return {}

    def close(self) -> None:
        for t in self.threads:
            t.join()


def config(tmp_path, **rl):
    sets = [
        f"rl.{k}={v}" for k, v in {"group_size": 4, "batch_groups": 2, "steps": 12, "max_staleness": 1, **rl}.items()
    ]
    return load_config(None, sets + [f"run.out_dir={tmp_path}", "rollout.retries=2"])


TASKS = [f"t{i}" for i in range(7)]


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_async_staleness_never_exceeds_bound(tmp_path, max_staleness):
    rt = SimRuntime(seed=max_staleness)
    orch = Orchestrator(config(tmp_path, max_staleness=max_staleness), rt, TASKS, "async", tmp_path / "rl")
    result = orch.run()
    rt.close()
    assert result["steps"] == 12
    assert all(r["staleness_max"] <= max_staleness for r in rows(tmp_path / "rl"))
    assert len(rt.trained) == len(set(rt.trained))  # nothing trained twice
    # every admitted sample is accounted for: trained, dropped (counted), or still in flight
    s = orch.buffer.stats()
    assert s["admitted"] == s["released"] + sum(s["dropped"].values()) + s["inflight"] + s["buffered"]


def test_sync_trains_only_on_fresh_work_between_drains(tmp_path):
    rt = SimRuntime(seed=1)
    orch = Orchestrator(config(tmp_path, steps=5, max_staleness=3), rt, TASKS, "sync", tmp_path / "rl")
    orch.run()
    rt.close()
    for r in rows(tmp_path / "rl"):
        assert r["staleness_max"] == 0 and r["groups"] == 2 and r["dropped"] == {}
    assert not orch.inflight  # drained at the end of every step


def test_lost_rollouts_are_relaunched_never_lost_or_trained_twice(tmp_path):
    lose = frozenset((f"g{p}", s) for p in range(0, 20, 3) for s in range(4))
    rt = SimRuntime(seed=2, lose=lose)
    # a bound as deep as the run (6 steps) leaves nothing to drop as stale, however slowly a relaunched
    # sample comes back (at 4, a loaded machine once trained a group without its late sample 0: by
    # design, a group whose stale samples are dropped trains on the rest)
    orch = Orchestrator(config(tmp_path, steps=6, max_staleness=6), rt, TASKS, "async", tmp_path / "rl")
    orch.run()
    rt.close()
    assert orch.counts["relaunched"] > 0 and orch.counts["lost"] == 0
    assert "stale" not in orch.buffer.stats()["dropped"]
    assert len(rt.trained) == len(set(rt.trained))
    trained_groups = {g for g, _ in rt.trained}
    for g in trained_groups:  # whole groups: every sample of a trained group arrived once
        assert sorted(s for gg, s in rt.trained if gg == g) == [0, 1, 2, 3]


def test_hack_flags_are_penalised_and_counted(tmp_path):
    rt = SimRuntime(seed=3, hacked_tasks=frozenset({"t0", "t3"}))
    orch = Orchestrator(config(tmp_path, steps=6, hack_penalty=2.0), rt, TASKS, "async", tmp_path / "rl")
    orch.run()
    rt.close()
    hacked = [s for s in rt.samples if s.trajectory.hack_flags]
    assert hacked and all(s.trajectory.task_id in ("t0", "t3") for s in hacked)
    last = rows(tmp_path / "rl")[-1]
    assert last["hacked_total"] == len(hacked) == orch.counts["hacked"]
    assert sum(r["hack_kinds"].get("test_edit", 0) for r in rows(tmp_path / "rl")) == len(hacked)
    # rewards are 0 or 1 and the penalty 2: a flagged sample gets the lowest advantage of its group
    for s in hacked:
        peers = [p for p in rt.samples if p.trajectory.group_id == s.trajectory.group_id]
        assert all(s.advantage <= p.advantage for p in peers)


class Killed(Exception):
    pass


def test_killed_run_resumes_from_checkpoint(tmp_path):
    cfg = config(tmp_path, steps=8, max_staleness=2)
    rt = SimRuntime(seed=4)
    orch = Orchestrator(cfg, rt, TASKS, "async", tmp_path / "rl")
    train = rt.train

    def dies_at_step_6(samples):
        if rt.version == 5:
            raise Killed()
        return train(samples)

    rt.train = dies_at_step_6
    with pytest.raises(Killed):
        orch.run()
    rt.close()
    position = json.loads((tmp_path / "rl" / "checkpoint" / "run.json").read_text())["sampler"]["position"]
    assert len(rows(tmp_path / "rl")) == 5

    rt2 = SimRuntime(seed=5)
    orch2 = Orchestrator(cfg, rt2, TASKS, "async", tmp_path / "rl")
    assert orch2.resume()
    assert orch2.step == 5 and rt2.version == 5 and orch2.sampler.position == position
    orch2.run()
    rt2.close()
    assert [r["step"] for r in rows(tmp_path / "rl")] == list(range(1, 9))
    assert len(rt2.trained) == len(set(rt2.trained))  # the resumed trainer state carries what was trained


def test_task_sampler_is_a_seeded_permutation_per_epoch():
    s = TaskSampler(TASKS, seed=7)
    first = [s.next()[1] for _ in range(7)]
    assert sorted(first) == sorted(TASKS)
    again = TaskSampler(TASKS, seed=7, position=3)
    assert again.next()[1] == first[3]


def test_rl_can_leave_out_the_tasks_sft_demonstrated():
    """`rollout.train_start`: RL draws train tasks from that index on, so a warm start cannot have
    memorized their answers; past the split's end it is a user error, not an empty run."""
    from strop.errors import UserError
    from strop.runtime.rl_run import train_tasks

    chain = ["rollout.suite=chain", "rollout.difficulties=[2]", "rollout.train_tasks=3"]
    assert [t.id for t in train_tasks(load_config(None, chain))][0] == "chain-d2-train-0000"
    later = train_tasks(load_config(None, [*chain, "rollout.train_start=600"]))
    assert [t.id for t in later] == [f"chain-d2-train-{i:04d}" for i in (600, 601, 602)]
    with pytest.raises(UserError, match="train_start = 1000 leaves no train tasks"):
        train_tasks(load_config(None, [*chain, "rollout.train_start=1000"]))
