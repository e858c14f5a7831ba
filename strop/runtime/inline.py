"""The `inline` runtime: trainer, engines and rollout workers in one process, on threads.

Placement only; what happens is the orchestrator's. The trainer runs on the caller's thread
(the orchestrator's main loop), each engine on its own loop thread (continuous batching across
all the workers that share it; or a served engine, vLLM or a URL, by `rollout.engine`: see
`strop.runtime.engines`), and rollouts on a thread pool — their sandboxes and checker runs
are child processes, so most of a rollout's time is spent outside the GIL.

`cpus` splits the machine the way a cluster is split: the trainer is pinned to `cpus.trainer`,
engine loop and rollout threads (and the sandboxes they fork) to `cpus.rollout`, so a busy
fraction measures a component against the hardware it was given (or, `split_cores(share=True)`,
both sides use every core, each taking what the other leaves idle). Threads of one process share
the GIL, and a tiny model's forward is mostly Python, so a trainer thread and an engine thread
slow each other down by about half; `trainer_process=True` moves the trainer into a child
process (`strop.runtime.trainers.TrainerProcess`, same calls over a pipe) so the split is real.

Weights take the one transport every runtime uses (`strop.sync`): the trainer (child process or
not) encodes each version's delta itself and publishes it to the store and its origin; one relay
(this machine is one inference cluster) pulls it once and serves the engines, whose sync threads
patch them in place (`strop.runtime.weights`). Nothing but metrics comes back over the pipe.
"""

import os
import queue
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

from strop.config import Config
from strop.env.harness.loop import Harness, harness_config
from strop.env.task import Task
from strop.gc_freeze import freeze_long_lived
from strop.memory import retain_freed_memory
from strop.rl.advantages import Sample
from strop.rl.rollout import RolloutLost, WorkItem, rollout, sandbox_limits
from strop.rl.trajectory import Trajectory
from strop.runtime.cpus import CpuSplit, cpu_reading, pin
from strop.runtime.engines import RunEngine, start_engine, summed_stats
from strop.runtime.trainers import TrainerProcess, start_trainer
from strop.runtime.weights import relay_keep, sync_seconds
from strop.sync.relay import Relay
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


SYNC_TIMEOUT_S = 600.0  # an engine that has not caught up by then is broken, not slow


class InlineRuntime:
    """Trainer, one inference cluster (one relay, `rollout.engines` engines) and rollout threads
    on this machine; weights flow through the same transport as on Ray (`strop.sync`)."""

    def __init__(
        self,
        cfg: Config,
        policy_dir: str,
        tasks: dict[str, Task],
        replay_ctx,
        *,
        cpus: CpuSplit | None = None,
        trainer_process: bool = False,
        store_url: str | None = None,
    ):
        from strop.data.tokenizer import load_tokenizer

        r = cfg.rollout
        self.tasks, self.cpus = tasks, cpus
        self.tokenizer = load_tokenizer(policy_dir)
        self._caller_cpus = os.sched_getaffinity(threading.get_native_id())  # restored by close()
        self._tmp = None if store_url else tempfile.TemporaryDirectory(prefix="strop-weights-")
        self.store_url = store_url or self._tmp.name
        pad_id = self.tokenizer.pad_token_id or 0
        if trainer_process:
            self.trainer = TrainerProcess(
                cfg, policy_dir, replay_ctx, pad_id, cpus.trainer if cpus else None, self.store_url
            )
            pin(cpus.rollout if cpus else None)  # the orchestrator loop stays off the trainer's core
        else:
            pin(cpus.trainer if cpus else None)
            self.trainer = start_trainer(cfg, policy_dir, replay_ctx, pad_id, self.store_url)
        self.trainer.publish()  # version 0: the store's snapshot, the base of the first delta
        self.relay = Relay(self.trainer.origin_url, cfg.sync.lan_mb_s * 1e6 or None, keep=relay_keep(cfg)).start()
        self.engines: list[RunEngine] = []
        for i in range(r.engines):
            self.engines.append(
                start_engine(
                    cfg,
                    i,
                    policy_dir,
                    self.tokenizer,
                    self.store_url,
                    self.relay.link(),
                    self.trainer.origin_url,
                    cpus.rollout if cpus else None,
                )
            )
        self.wait_synced()  # engines serve exactly the bf16 weights the trainer published
        self.harness = Harness(self.tokenizer, harness_config(r, cfg.harness))
        self.limits = sandbox_limits(r)
        self.pool = ThreadPoolExecutor(
            r.workers, thread_name_prefix="strop-rollout", initializer=pin, initargs=(cpus.rollout if cpus else None,)
        )
        self.done: queue.Queue[Result] = queue.Queue()
        self._next = 0
        freeze_long_lived()  # the engines' loops run beside it: a full collection stops them

    # ---- rollouts --------------------------------------------------------------------------

    def submit(self, item: WorkItem) -> None:
        engine = self.engines[self._next % len(self.engines)]  # round robin: a relaunch lands elsewhere
        self._next += 1
        self.pool.submit(self._run, item, engine)

    def _run(self, item: WorkItem, engine: RunEngine) -> None:
        try:
            self.done.put(
                (item, rollout(self.tasks[item.task_id], engine.policy(), self.harness, item, self.limits), None)
            )
        except RolloutLost as e:
            self.done.put((item, None, str(e)))

    def results(self, timeout: float) -> list[Result]:
        """Whatever finished, waiting up to `timeout` seconds for the first one."""
        return drain(self.done, timeout)

    # ---- training and weights --------------------------------------------------------------

    def train(self, samples: list[Sample]) -> dict:
        """One trainer step; the trainer publishes the new version itself, and the engines'
        sync threads swap it in as it arrives. The relay pulls it right away, while the trainer
        waits for its next call: a busy trainer process answers its origin's requests late."""
        row = self.trainer.step(samples)
        self.relay.pull(row["version"])
        return row

    def wait_synced(self) -> None:
        """Block until every engine serves the last published version."""
        for s in self.engines:
            if not s.wait_version(self.trainer.version, SYNC_TIMEOUT_S):
                raise RuntimeError(f"an engine did not reach version {self.trainer.version} in {SYNC_TIMEOUT_S:.0f} s")

    @property
    def bytes_synced(self) -> int:
        """Bytes that left the trainer for the engines (its origin's egress)."""
        return self.trainer.sync_stats()["bytes_sent"]

    @property
    def version(self) -> int:
        return self.trainer.version

    def state_dict(self) -> dict:
        return self.trainer.state_dict()

    def save(self, path) -> None:
        self.trainer.save(path)

    def load(self, path) -> None:
        self.trainer.load(path)  # published as a new chain; the engines fetch what differs
        self.wait_synced()

    def sync_seconds(self) -> dict[int, float]:
        """Per version: seconds from its publication to the last engine serving it (`sync_seconds`),
        once every engine serves the last one."""
        self.wait_synced()
        return sync_seconds(self.trainer.sync_stats()["published_at"], [e.sync.swapped_at for e in self.engines])

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by the trainer's process, this one and the whole machine
        (`strop.runtime.cpus.cpu_reading`)."""
        return cpu_reading(self.trainer.proc.pid if isinstance(self.trainer, TrainerProcess) else None)

    def engine_stats(self) -> dict:
        """The engines' figures (`RunEngine.stats`) summed, and `engines`, how many."""
        return {**summed_stats([e.stats() for e in self.engines]), "engines": len(self.engines)}

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for e in self.engines:
            e.close()
        self.relay.close()
        self.trainer.close()
        if self._tmp is not None:
            self._tmp.cleanup()
        pin(frozenset(self._caller_cpus))


def start_inline(
    cfg: Config,
    policy_dir: str,
    tasks: dict[str, Task],
    replay_ctx,
    cpus: CpuSplit | None = None,
    trainer_process: bool = False,
    store_url: str | None = None,
) -> InlineRuntime:
    """`store_url`: the versioned weight store (default: a temporary directory, removed at close)."""
    # placed: one thread per role, so the engine's torch ops never spill onto the trainer's core
    set_threads(1 if cpus else (cfg.run.threads or None))
    retain_freed_memory()  # engine steps and weight publishing allocate the same buffers every time (see _trainer_main)
    return InlineRuntime(
        cfg, policy_dir, tasks, replay_ctx, cpus=cpus, trainer_process=trainer_process, store_url=store_url
    )
