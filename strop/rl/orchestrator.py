"""The RL orchestrator: one main loop that keeps rollouts flowing into the staleness-bounded buffer
and groups flowing into the trainer, in `async` or `sync` mode, on any runtime.

    loop until rl.steps:
        admit + launch   new work items (task, group, sample) while the buffer has room
        collect          finished rollouts -> buffer (a lost one is relaunched, or given up on)
        train            once rl.batch_groups complete groups are ready: advantages -> trainer
                         step -> new version published to the engines -> buffer.set_version
        checkpoint       every rollout.ckpt_every steps, atomically

The two modes differ in one place, when work may be launched:
- `async`: whenever the buffer admits it, so rollouts always run on the newest weights the
  engines hold while the trainer consumes groups as they complete; the per-sample staleness bound
  is the buffer's (asserted when it hands groups out), producers are paced by its admission
  control, and anything that still went stale is dropped and counted.
- `sync`: only when the pipeline is drained (nothing in flight or buffered), and then exactly one
  step's worth; the trainer steps, the engines are synced, and only then does generation resume.

The runtime places the pieces (`strop.runtime.inline`: threads; `strop.runtime.ray.actors`:
actors) behind the `Runtime` protocol below, and the orchestrator never reaches into it: four calls
move work (`submit`, `results`, `train`, `wait_synced`), three carry the state a checkpoint holds
(`version`, `save`, `load`), two report figures (`bytes_synced`, `engine_stats`), and `close` is
for whoever started it (`strop.runtime.rl_run.train_rl`). Components never call back into the orchestrator.

Exactly-once: every work item is keyed (group_id, sample). A lost rollout (its engine or worker
died) is relaunched under the same key with its reservation kept; the buffer refuses a second
delivery of a key, and a group handed to the trainer is never handed out again. A checkpoint holds
the trainer state (written by the trainer itself, each rank its shards: `strop.checkpoint`), the
buffer contents, the items in flight (relaunched on resume), the task sampler's state (its position,
and the curriculum's estimates: `strop.rl.curriculum`) and the RNG state; rerunning the command
resumes from it.
"""

import contextlib
import random
import time
from collections import Counter
from pathlib import Path
from typing import Callable, ContextManager, Literal, Protocol

import torch

from strop.checkpoint import find_checkpoint, load_state, save_checkpoint
from strop.config import Config
from strop.env.grading.behaviour import summarize
from strop.report import MetricsLog
from strop.rl.advantages import Sample, make_samples
from strop.rl.budget import cpu_budget, engine_budget, episode_budget
from strop.rl.buffer import StalenessBuffer
from strop.rl.curriculum import EdgeSampler, solve_by_difficulty
from strop.rl.rollout import WorkItem
from strop.rl.rollout_log import RolloutLog, record
from strop.rl.trajectory import Trajectory, TrajectoryGroup
from strop.tracking import open_tracker

Mode = Literal["sync", "async"]
_STATE = "run.json"  # the checkpoint's state file (strop.checkpoint)
# behaviour statistics logged per step (`strop.env.grading.behaviour.summarize`): what RL changes
TRACKED_BEHAVIOUR = ("retry_after_rejected_edit", "rejected_edit", "test_runs", "submitted_untested", "turns")


class Runtime(Protocol):
    """Where the trainer, engines and rollouts run, as the orchestrator sees it (module docstring)."""

    # work
    def submit(self, item: WorkItem) -> None: ...
    def results(self, timeout: float) -> list[tuple[WorkItem, Trajectory | None, str | None]]: ...
    def train(self, samples: list[Sample]) -> dict: ...
    def wait_synced(self) -> None: ...

    # the state a checkpoint holds
    @property
    def version(self) -> int: ...
    def save(self, path: Path) -> None: ...  # the trainer's files of a checkpoint, into the directory `path`
    def load(self, path: Path) -> None: ...  # the trainer state `save` wrote in `path`

    # figures
    bytes_synced: int

    def engine_stats(self) -> dict: ...  # engines' counters summed (`strop.rl.budget`), `busy_s`, and `engines`
    def cpu_seconds(self) -> dict[str, float]: ...  # CPU seconds so far, by whom; {} if unknown

    # for whoever started it
    def close(self) -> None: ...


def router_replay(model, batch) -> ContextManager:
    """The trainer's `replay_ctx` for MoE policies: each forward routes through the experts the
    engine used (`batch.routing[b][t]` for input position t). Positions with nothing recorded
    (those whose next token was forced: prompt and tool observations) keep the trainer's own
    choice, made in the same forward."""
    from strop.model.routing import replay_routing

    first = next((r for row in batch.routing for r in row if r is not None), None)
    if first is None:
        return contextlib.nullcontext()
    B, T = batch.input_ids_BT.shape
    ids = torch.full((B, T, len(first), len(first[0])), -1, dtype=torch.long)  # -1: not recorded
    for b, row in enumerate(batch.routing):
        recorded = [t for t, r in enumerate(row) if r is not None]
        if recorded:
            ids[b, recorded] = torch.tensor([row[t] for t in recorded], dtype=torch.long)
    return replay_routing(model, ids.to(batch.input_ids_BT.device))  # the batch's device: the trainer's


class TaskSampler:
    """An endless, seeded stream of task ids: a fresh permutation of the tasks every epoch.
    Its whole state is `position`, so a resumed run draws exactly the tasks it would have."""

    def __init__(self, task_ids: list[str], seed: int, position: int = 0):
        assert task_ids, "no tasks to sample"
        self.task_ids, self.seed, self.position = sorted(task_ids), seed, position

    def next(self) -> tuple[int, str]:
        epoch, i = divmod(self.position, len(self.task_ids))
        order = random.Random(f"{self.seed}/{epoch}").sample(range(len(self.task_ids)), len(self.task_ids))
        drawn = self.position, self.task_ids[order[i]]
        self.position += 1
        return drawn

    def observe(self, groups) -> None:
        """Uniform: the outcomes change nothing (`strop.rl.curriculum.EdgeSampler` learns from them)."""

    def figures(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


class Orchestrator:
    def __init__(
        self,
        cfg: Config,
        runtime: Runtime,
        task_ids: list[str],
        mode: Mode,
        out_dir: Path,
        log: Callable[[dict], None] = lambda row: None,
        difficulties: dict[str, int] | None = None,
    ):
        rl = cfg.rl
        self.cfg, self.runtime, self.mode, self.out_dir, self.log = cfg, runtime, mode, Path(out_dir), log
        # sync trains on exactly what it just generated: one step's worth, staleness 0
        staleness = 0 if mode == "sync" else rl.max_staleness
        capacity = rl.batch_groups * rl.group_size if mode == "sync" else rl.inflight_limit
        self.buffer = StalenessBuffer(rl.group_size, staleness, capacity)
        self.difficulties = difficulties or {}  # task id -> difficulty: the curriculum's and the metrics' levels
        if rl.curriculum == "edge":
            explore, memory = rl.curriculum_explore, rl.curriculum_memory
            self.sampler = EdgeSampler(task_ids, self.difficulties, cfg.run.seed, explore, memory)
        else:
            self.sampler = TaskSampler(task_ids, cfg.run.seed)
        self.rng = random.Random(cfg.run.seed)
        self.inflight: dict[tuple[str, int], WorkItem] = {}
        self.counts: Counter = Counter()  # relaunched, lost, hacked, trained
        self.step = 0
        self.elapsed_s = 0.0  # wall time of previous sessions of this run (resume)
        self.trainer_s = 0.0
        self.metrics = MetricsLog(self.out_dir / "metrics.jsonl", open_tracker(cfg, "rl"))
        # what the policy did each step, for `strop runs show` and the report (cfg.log.rollouts)
        self.rollouts = RolloutLog(self.out_dir / "rollouts", cfg.log.rollouts_max_mb, self.metrics.tracker)
        self.ckpt_dir = self.out_dir / "checkpoint"

    # ---- launching and collecting ----------------------------------------------------------

    def _launch(self, item: WorkItem) -> None:
        self.inflight[item.key] = item
        self.runtime.submit(item)

    def _fill(self) -> None:
        rl = self.cfg.rl
        if self.mode == "sync":
            stats = self.buffer.stats()
            if self.inflight or stats["buffered"]:
                return
            n_groups = rl.batch_groups
        else:
            n_groups = None
        version = self.runtime.version
        launched = 0
        while n_groups is None or launched < n_groups:
            if not self.buffer.admit(version, rl.group_size):
                break  # paced: the buffer has no room for a whole group at this version
            position, task_id = self.sampler.next()
            group_id = f"g{position}"
            for s in range(rl.group_size):
                self._launch(WorkItem(task_id, group_id, s, self.rng.randrange(2**31), version))
            launched += 1

    def _collect(self, timeout: float) -> None:
        for item, traj, lost in self.runtime.results(timeout):
            if self.inflight.get(item.key) != item:
                continue  # a superseded attempt (relaunched after a resume): its successor owns the key
            del self.inflight[item.key]
            if traj is not None:
                self.buffer.put(traj)
            elif item.attempt < self.cfg.rollout.retries:
                self.counts["relaunched"] += 1
                relaunched = WorkItem(
                    item.task_id, item.group_id, item.sample, item.seed, self.runtime.version, item.attempt + 1
                )
                self._launch(relaunched)  # keeps the reservation; another engine takes it (round robin)
            else:
                self.counts["lost"] += 1
                self.buffer.cancel(item.group_id, item.sample, "lost")
                print(f"[rl] gave up on {item.key}: {lost}", flush=True)

    def _ready_groups(self) -> list[TrajectoryGroup]:
        rl = self.cfg.rl
        if self.mode == "sync" and not self.inflight:
            # everything generated is in: train on what survived even if a group was given up on
            n = self.buffer.stats()["ready_groups"]
            return self.buffer.get(n, timeout=0) if n else []
        return self.buffer.get(rl.batch_groups, timeout=0)

    # ---- training --------------------------------------------------------------------------

    def _train(self, groups: list[TrajectoryGroup], t_run: float, t_last: float) -> float:
        rl = self.cfg.rl
        samples = make_samples(
            groups,
            dr_grpo=rl.dr_grpo,
            norm_tokens=rl.dr_grpo_norm_tokens,
            hack_penalty=rl.hack_penalty,
            degenerate_penalty=rl.degenerate_penalty,
            reward_power=rl.reward_power,
            solve_bonus=rl.solve_bonus,
            negative_weight=rl.negative_weight,
            placebo_seed=self.cfg.run.seed if rl.placebo else None,
        )
        t0 = time.perf_counter()
        row = self.runtime.train(samples)
        train_s = time.perf_counter() - t0
        self.trainer_s += train_s
        if self.mode == "sync":
            self.runtime.wait_synced()  # generation resumes only on the new weights
        self.buffer.set_version(self.runtime.version)
        self.step += 1
        now = time.perf_counter()
        wall = self.elapsed_s + now - t_run
        trajs = [s.trajectory for s in samples]
        self.sampler.observe(groups)
        engines, cpu = self.runtime.engine_stats(), self.runtime.cpu_seconds()
        budget = {
            "time_step_s": now - t_last,
            "time_wait_s": t0 - t_last,
            "time_train_s": train_s,
            **episode_budget(t.timings for t in trajs),
            **engine_budget(self._engines_before, engines, now - t_last),
            **cpu_budget(self._cpu_before, cpu),
        }
        self._engines_before, self._cpu_before = engines, cpu
        self.counts["hacked"] += sum(bool(t.hack_flags) for t in trajs)
        self.counts["trained"] += len(trajs)
        stats = self.buffer.stats()
        behaviour = summarize([t.behaviour for t in trajs])
        row = {
            "step": self.step,
            "mode": self.mode,
            **row,
            "groups": len(groups),
            "mixed_groups": sum(
                len({s.advantage for s in samples if s.trajectory.group_id == g.group_id}) > 1 for g in groups
            )
            / len(groups),
            **solve_by_difficulty(groups, self.difficulties),
            **self.sampler.figures(),
            **{f"behaviour_{k}": behaviour.get(k) for k in TRACKED_BEHAVIOUR},
            "hack_kinds": dict(Counter(f["kind"] for t in trajs for f in t.hack_flags)),
            "hacked_total": self.counts["hacked"],
            "dropped": stats["dropped"],
            "dropped_stale": stats["dropped"].get("stale", 0),
            "relaunched": self.counts["relaunched"],
            "lost": self.counts["lost"],
            "rollout_tokens_per_s": sum(t.generated_tokens for t in trajs) / max(now - t_last, 1e-9),
            "trainer_busy": self.trainer_s / wall,
            "engine_busy": engines.get("busy_s", 0.0) / engines.get("engines", 1) / wall,
            "bytes_synced": self.runtime.bytes_synced,
            "wall_s": wall,
            **budget,
        }
        self.metrics.write(row)
        if self.cfg.log.rollouts:
            self.rollouts.write_step(self.step, [record(s.trajectory, s.advantage, self.step) for s in samples])
        self.log(row)
        if self.step % self.cfg.rollout.ckpt_every == 0 or self.step == rl.steps:
            self.save(wall)
        return now

    def run(self) -> dict:
        """Train until `rl.steps`; returns the last metrics row's key figures."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._engines_before, self._cpu_before = self.runtime.engine_stats(), self.runtime.cpu_seconds()
        t_run = t_last = time.perf_counter()
        while self.step < self.cfg.rl.steps:
            self._fill()
            self._collect(timeout=0.02)
            groups = self._ready_groups()
            if groups:
                t_last = self._train(groups, t_run, t_last)
        self.metrics.close()
        engines = self.runtime.engine_stats()
        return {
            "steps": self.step,
            "wall_s": self.elapsed_s + time.perf_counter() - t_run,
            "trainer_s": self.trainer_s,
            "engine_busy_s": engines.get("busy_s", 0.0) / engines.get("engines", 1),  # the average engine's
            "buffer": self.buffer.stats(),
            **dict(self.counts),
        }

    # ---- checkpoint / resume ---------------------------------------------------------------

    def save(self, wall_s: float) -> None:
        """Everything a rerun needs, as a checkpoint (`strop.checkpoint`: a kill at any point leaves
        the previous one or this one, never half of one)."""
        state = {
            "step": self.step,
            "mode": self.mode,
            "wall_s": wall_s,
            "trainer_s": self.trainer_s,
            "sampler": self.sampler.state_dict(),
            "rng": _rng_to_json(self.rng.getstate()),
            "counts": dict(self.counts),
            "buffer": self.buffer.state_dict(),
            "inflight": [i.to_dict() for i in self.inflight.values()],
        }
        save_checkpoint(self.ckpt_dir, state, self.runtime.save, state_name=_STATE)

    def resume(self) -> bool:
        """Load the last checkpoint if there is one (relaunching the work that was in flight)."""
        ckpt = find_checkpoint(self.ckpt_dir, _STATE)
        if ckpt is None:  # a run killed before its first checkpoint starts again: so do its rows
            self.metrics.truncate_after(0)
            self.rollouts.truncate_after(0)
            return False
        state = load_state(ckpt, _STATE)
        assert state["mode"] == self.mode, f"checkpoint is of a {state['mode']} run, not {self.mode}"
        self.runtime.load(ckpt)
        self.buffer.load_state_dict(state["buffer"])
        assert self.buffer.version == self.runtime.version, "buffer and trainer checkpoints disagree on the version"
        self.step, self.elapsed_s, self.trainer_s = state["step"], state["wall_s"], state["trainer_s"]
        self.sampler.load_state_dict(state["sampler"])
        self.rng.setstate(_rng_from_json(state["rng"]))
        self.counts = Counter(state["counts"])
        # metrics rows past the checkpoint belong to steps that will be redone
        self.metrics.truncate_after(self.step)
        self.rollouts.truncate_after(self.step)
        for d in state["inflight"]:
            item = WorkItem(**{**d, "version": self.runtime.version})
            assert self.buffer.admit(item.version, 1), "no room to relaunch in-flight work on resume"
            self._launch(item)
        return True


def _rng_to_json(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_from_json(state: list) -> tuple:
    return state[0], tuple(state[1]), state[2]
