"""The `inline` runtime: trainer, engines and rollout workers in one process, on threads.

Placement only; what happens is the orchestrator's. The trainer runs on the caller's thread
(the orchestrator's main loop), each engine on its own loop thread (continuous batching across
all the workers that share it), and rollouts on a thread pool — their sandboxes and checker runs
are child processes, so most of a rollout's time is spent outside the GIL.

`cpus` splits the machine the way a cluster is split: the trainer is pinned to `cpus.trainer`,
engine loop and rollout threads (and the sandboxes they fork) to `cpus.rollout`, so a busy
fraction measures a component against the hardware it was given. Threads of one process share
the GIL, and a tiny model's forward is mostly Python, so a trainer thread and an engine thread
slow each other down by about half; `trainer_process=True` moves the trainer into a child
process (`TrainerProcess`, same calls over a pipe) so the split is real.
"""

import multiprocessing
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from strop.config import Config, RLSection
from strop.engine.engine import Engine
from strop.env.harness import Harness
from strop.env.task import Task
from strop.rl.advantages import Sample
from strop.engine.policy_client import EnginePolicy
from strop.memory import retain_freed_memory
from strop.rl.rollout import RolloutLost, WorkItem, harness_config, rollout, sandbox_limits
from strop.rl.trainer import RLTrainer
from strop.rl.trajectory import Trajectory
from strop.sync.publisher import DeltaPublisher
from strop.threads import set_threads

Result = tuple[WorkItem, Trajectory | None, str | None]  # (item, trajectory, why it was lost)


def drain(q: queue.Queue, timeout: float) -> list:
    """Everything in `q`, waiting up to `timeout` seconds for the first item ([] if none came)."""
    try:
        out = [q.get(timeout=timeout)]
    except queue.Empty:
        return []
    while not q.empty():
        out.append(q.get_nowait())
    return out


@dataclass(frozen=True)
class CpuSplit:
    trainer: frozenset[int]
    rollout: frozenset[int]


def split_cores() -> CpuSplit | None:
    """The trainer on the first allowed core, engines and rollouts on the others (None on one core)."""
    cpus = sorted(os.sched_getaffinity(0))
    return CpuSplit(frozenset(cpus[:1]), frozenset(cpus[1:])) if len(cpus) >= 2 else None


def pin(cpus: frozenset[int] | None) -> None:
    """Pin the calling thread (not the process: Linux affinity is per thread) to `cpus`."""
    if cpus:
        os.sched_setaffinity(threading.get_native_id(), cpus)


class TimedEngine(Engine):
    """An `Engine` that counts the seconds its steps did work (its busy time) and pins its loop
    thread on the first step."""

    def __init__(self, *args, cpus: frozenset[int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.busy_s = 0.0
        self._cpus, self._pinned = cpus, False

    def step(self) -> bool:
        if not self._pinned:
            pin(self._cpus)
            self._pinned = True
        t0 = time.perf_counter()
        worked = super().step()
        if worked:
            self.busy_s += time.perf_counter() - t0
        return worked


def _trainer_main(conn, rl: RLSection, policy_dir: str, replay_ctx, pad_id: int, cpus: frozenset[int] | None) -> None:
    """The child process of `TrainerProcess`: an `RLTrainer` answering (call, argument) messages."""
    from strop.model.policy import load_model

    set_threads(1)
    pin(cpus)
    # A step allocates and frees the same activations every time; handed back to the kernel
    # between steps, they are faulted in afresh on the next (and in a VM, freed pages idle for a
    # second or two are returned to the host, which makes those faults slow): keep them.
    retain_freed_memory()
    published: dict = {}
    trainer = RLTrainer(load_model(policy_dir), rl, pad_id=pad_id, replay_ctx=replay_ctx,
                        publish=lambda version, state: published.update(state=state))
    calls = {"step": lambda samples: (trainer.step(samples), published.pop("state")),
             "state_dict": lambda _: trainer.state_dict(),
             "load_state_dict": lambda state: trainer.load_state_dict(state),
             "bf16_state_dict": lambda _: trainer.bf16_state_dict()}
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        call, arg = msg
        conn.send((calls[call](arg), trainer.version))


class TrainerProcess:
    """An `RLTrainer` in a child process, with the calls the runtime makes; `step` returns the
    metrics row and hands the published bf16 snapshot to `publish`, as the in-process trainer does."""

    def __init__(self, cfg: Config, policy_dir: str, replay_ctx, pad_id: int, publish, cpus: frozenset[int] | None):
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs torch threads
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_trainer_main, args=(child, cfg.rl, policy_dir, replay_ctx, pad_id, cpus),
                                name="strop-trainer", daemon=True)
        self.proc.start()
        assert self.conn.recv() == "ready"
        self.publish, self.version = publish, 0

    def _call(self, call: str, arg=None):
        self.conn.send((call, arg))
        result, self.version = self.conn.recv()
        return result

    def step(self, samples: list[Sample]) -> dict:
        row, state = self._call("step", samples)
        self.publish(self.version, state)
        return row

    def state_dict(self) -> dict:
        return self._call("state_dict")

    def load_state_dict(self, state: dict) -> None:
        self._call("load_state_dict", state)

    def bf16_state_dict(self) -> dict[str, torch.Tensor]:
        return self._call("bf16_state_dict")

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=30)


def snapshot_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class InlineRuntime:
    def __init__(self, cfg: Config, policy_dir: str, tasks: dict[str, Task], replay_ctx, *, cpus: CpuSplit | None = None,
                 trainer_process: bool = False):
        from strop.data.tokenizer import load_tokenizer
        from strop.model.policy import load_model

        r = cfg.rollout
        self.tasks, self.cpus = tasks, cpus
        self.tokenizer = load_tokenizer(policy_dir)
        self._caller_cpus = os.sched_getaffinity(threading.get_native_id())  # restored by close()
        pad_id = self.tokenizer.pad_token_id or 0
        if trainer_process:
            self.trainer = TrainerProcess(cfg, policy_dir, replay_ctx, pad_id, self._publish, cpus.trainer if cpus else None)
            pin(cpus.rollout if cpus else None)  # the orchestrator loop stays off the trainer's core
        else:
            pin(cpus.trainer if cpus else None)
            self.trainer = RLTrainer(load_model(policy_dir), cfg.rl, pad_id=pad_id, publish=self._publish, replay_ctx=replay_ctx)
        self.publisher = DeltaPublisher()
        start, _ = self.publisher.publish(0, self.trainer.bf16_state_dict())  # the base of the first delta
        self.engines: list[TimedEngine] = []
        for i in range(r.engines):
            engine = TimedEngine(load_model(policy_dir), self.tokenizer, max_batch=r.engine_batch, max_len=r.max_context,
                                 seed=cfg.run.seed + i, cpus=cpus.rollout if cpus else None)
            engine.update_weights(tensors=start, version=0)  # engines serve exactly the bf16 weights the trainer publishes
            engine.start()
            self.engines.append(engine)
        self.harness = Harness(self.tokenizer, harness_config(r))
        self.limits = sandbox_limits(r)
        self.pool = ThreadPoolExecutor(r.workers, thread_name_prefix="strop-rollout",
                                       initializer=pin, initargs=(cpus.rollout if cpus else None,))
        self.done: queue.Queue[Result] = queue.Queue()
        self.bytes_synced = 0
        self._next = 0
        self._updates: list = []

    # ---- rollouts --------------------------------------------------------------------------

    def submit(self, item: WorkItem) -> None:
        engine = self.engines[self._next % len(self.engines)]  # round robin: a relaunch lands elsewhere
        self._next += 1
        self.pool.submit(self._run, item, engine)

    def _run(self, item: WorkItem, engine: Engine) -> None:
        try:
            self.done.put((item, rollout(self.tasks[item.task_id], EnginePolicy(engine), self.harness, item, self.limits), None))
        except RolloutLost as e:
            self.done.put((item, None, str(e)))

    def results(self, timeout: float) -> list[Result]:
        """Whatever finished, waiting up to `timeout` seconds for the first one."""
        return drain(self.done, timeout)

    # ---- training and weights --------------------------------------------------------------

    def train(self, samples: list[Sample]) -> dict:
        return self.trainer.step(samples)

    def _publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Ship `state` to every engine as a delta against the last published version."""
        state, nbytes = self.publisher.publish(version, state)
        self._updates = [e.update_weights(tensors=state, version=version) for e in self.engines]
        self.bytes_synced += nbytes * len(self.engines)

    def wait_synced(self) -> None:
        """Block until every engine serves the last published version."""
        for u in self._updates:
            u.wait()

    @property
    def version(self) -> int:
        return self.trainer.version

    def state_dict(self) -> dict:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.trainer.load_state_dict(state)
        self.publisher.reset()  # the engines get the resumed weights whole
        self._publish(self.trainer.version, self.trainer.bf16_state_dict())
        self.wait_synced()

    def engine_busy_s(self) -> float:
        """Busy seconds of the average engine."""
        return sum(e.busy_s for e in self.engines) / len(self.engines)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for e in self.engines:
            e.stop()
        if isinstance(self.trainer, TrainerProcess):
            self.trainer.close()
        pin(frozenset(self._caller_cpus))


def start_inline(cfg: Config, policy_dir: str, tasks: dict[str, Task], replay_ctx, cpus: CpuSplit | None = None,
                 trainer_process: bool = False) -> InlineRuntime:
    # placed: one thread per role, so the engine's torch ops never spill onto the trainer's core
    set_threads(1 if cpus else (cfg.run.threads or None))
    retain_freed_memory()  # engine steps and weight publishing allocate the same buffers every time (see _trainer_main)
    return InlineRuntime(cfg, policy_dir, tasks, replay_ctx, cpus=cpus, trainer_process=trainer_process)
