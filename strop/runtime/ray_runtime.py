"""The `ray` runtime: the trainer, the engines and the rollout workers as Ray actors.

    driver (orchestrator main loop) ──step(samples)──► TrainerActor ──bf16 snapshot (one object)──┐
         │ run(item, task, engine)                                                              ▼
         └──────────────► RolloutActor ×N ──generate(ids)──► EngineActor ×M (cluster label) ◄─ update

A local Ray instance starts by itself (light: 2 CPUs, no dashboard); `address` joins a cluster.
Actors ask for no CPUs from Ray's scheduler (their threads are pinned by `cpus`, when given, as in
the inline runtime) so a small machine can hold them all. Every actor process calls
`set_threads` first.

Engines carry a cluster label and may join (`add_engine`) and leave (`remove_engine`, or die)
while the run goes on. Work on a lost engine or worker comes back as lost (`results`); the
orchestrator relaunches it under the same key and `submit` sends it to a live engine — a dead
rollout worker is replaced. The published snapshot is put into the object store once and every
engine pulls it from there.
"""

import os
import time

import ray

from strop.config import Config, RLSection, RolloutSection
from strop.env.policy import Generation, SamplingParams
from strop.env.task import Task
from strop.rl.advantages import Sample
from strop.rl.rollout import RolloutLost, WorkItem
from strop.rl.trajectory import Trajectory
from strop.runtime.inline import CpuSplit, snapshot_bytes

ROLLOUT_ACTORS = 2  # rollout processes; each runs ceil(workers / ROLLOUT_ACTORS) episodes on threads
LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def _start_process(cpus: frozenset[int] | None) -> None:
    from strop.threads import set_threads

    set_threads(1)
    if cpus:
        os.sched_setaffinity(0, cpus)  # the actor's main thread; threads it starts inherit it


@ray.remote(num_cpus=0)
class TrainerActor:
    def __init__(self, rl: RLSection, policy_dir: str, replay_ctx, pad_id: int, cpus: frozenset[int] | None):
        _start_process(cpus)
        from strop.model.policy import load_model
        from strop.rl.trainer import RLTrainer

        self.published: dict = {}
        self.trainer = RLTrainer(load_model(policy_dir), rl, pad_id=pad_id, replay_ctx=replay_ctx,
                                 publish=lambda version, state: self.published.update(state=state))

    def step(self, samples: list[Sample]) -> dict:
        return self.trainer.step(samples)

    def snapshot(self) -> dict:
        """The last published bf16 snapshot (the initial weights before the first step)."""
        return self.published.get("state") or self.trainer.bf16_state_dict()

    def version(self) -> int:
        return self.trainer.version

    def state_dict(self) -> dict:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.trainer.load_state_dict(state)
        self.published["state"] = self.trainer.bf16_state_dict()


@ray.remote(num_cpus=0, max_concurrency=64)
class EngineActor:
    """One engine; its loop thread batches the turns of every rollout thread calling `generate`."""

    def __init__(self, r: RolloutSection, policy_dir: str, label: str, seed: int, cpus: frozenset[int] | None):
        _start_process(cpus)
        from strop.model.policy import load_model
        from strop.data.tokenizer import load_tokenizer
        from strop.runtime.inline import TimedEngine

        self.label = label
        self.engine = TimedEngine(load_model(policy_dir), load_tokenizer(policy_dir), max_batch=r.engine_batch,
                                  max_len=r.max_context, seed=seed, cpus=cpus)
        self.engine.start()

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        from strop.engine.policy_client import EnginePolicy

        return EnginePolicy(self.engine).generate(prompt_ids, params)

    def update(self, version: int, state: dict) -> float:
        return self.engine.update_weights(tensors=state, version=version).wait()

    def info(self) -> dict:
        return {"label": self.label, "version": self.engine.version, "busy_s": self.engine.busy_s, "pid": os.getpid()}


class RayPolicy:
    """A `PolicyClient` over an `EngineActor` handle; a dead engine raises (-> RolloutLost)."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        return ray.get(self.engine.generate.remote(prompt_ids, params))


@ray.remote(num_cpus=0, max_concurrency=64)
class RolloutActor:
    def __init__(self, r: RolloutSection, policy_dir: str, cpus: frozenset[int] | None):
        _start_process(cpus)
        from strop.data.tokenizer import load_tokenizer
        from strop.env.harness import Harness
        from strop.rl.rollout import harness_config, sandbox_limits

        self.harness = Harness(load_tokenizer(policy_dir), harness_config(r))
        self.limits = sandbox_limits(r)

    def run(self, item: WorkItem, task: Task, engine) -> tuple[Trajectory | None, str | None]:
        from strop.rl.rollout import rollout

        try:
            return rollout(task, RayPolicy(engine), self.harness, item, self.limits), None
        except RolloutLost as e:
            return None, str(e)

    def pid(self) -> int:
        return os.getpid()


class RayRuntime:
    def __init__(self, cfg: Config, policy_dir: str, tasks: dict[str, Task], replay_ctx, *,
                 cpus: CpuSplit | None = None, rollout_actors: int = ROLLOUT_ACTORS):
        from strop.data.tokenizer import load_tokenizer

        self.cfg, self.policy_dir, self.tasks = cfg, policy_dir, tasks
        self.cpus = cpus
        self.tokenizer = load_tokenizer(policy_dir)
        self.trainer = TrainerActor.remote(cfg.rl, policy_dir, replay_ctx, self.tokenizer.pad_token_id or 0,
                                           cpus.trainer if cpus else None)
        self.snapshot = self.trainer.snapshot.remote()
        self.snapshot_nbytes = snapshot_bytes(ray.get(self.snapshot))
        self._version = 0
        self.engines: dict[str, object] = {}  # name -> handle, live engines only
        self._engine_seq = 0
        for i in range(cfg.rollout.engines):
            self.add_engine(f"cluster-{i % 2}")
        per_actor = -(-cfg.rollout.workers // rollout_actors)
        self.workers = [self._new_worker(per_actor) for _ in range(rollout_actors)]
        self.per_actor = per_actor
        self.inflight: dict = {}  # object ref -> (item, worker index, worker handle, engine name)
        self.bytes_synced = 0
        self._updates: list = []
        self._busy_lost = 0.0  # busy seconds of engines that left
        self._last_busy: dict[str, float] = {}
        self._next = 0

    def _new_worker(self, concurrency: int):
        return RolloutActor.options(max_concurrency=concurrency).remote(
            self.cfg.rollout, self.policy_dir, self.cpus.rollout if self.cpus else None)

    # ---- engines joining and leaving -------------------------------------------------------

    def add_engine(self, label: str) -> str:
        """Start an engine on the current weights; it takes work from the next `submit` on."""
        name = f"engine-{self._engine_seq}"
        self._engine_seq += 1
        engine = EngineActor.remote(self.cfg.rollout, self.policy_dir, label,
                                                       self.cfg.run.seed + self._engine_seq,
                                                       self.cpus.rollout if self.cpus else None)
        ray.get(engine.update.remote(self._version, self.snapshot))
        self.engines[name] = engine
        return name

    def remove_engine(self, name: str) -> None:
        """Take an engine away (its in-flight work comes back lost and is relaunched elsewhere)."""
        engine = self.engines.pop(name)
        self._busy_lost += self._last_busy.pop(name, 0.0)
        ray.kill(engine)

    # ---- rollouts --------------------------------------------------------------------------

    def submit(self, item: WorkItem) -> None:
        assert self.engines, "no live engine left"
        names = sorted(self.engines)
        name = names[self._next % len(names)]
        w = self._next % len(self.workers)
        self._next += 1
        worker = self.workers[w]
        ref = worker.run.remote(item, self.tasks[item.task_id], self.engines[name])
        self.inflight[ref] = (item, w, worker, name)

    def results(self, timeout: float) -> list[tuple[WorkItem, Trajectory | None, str | None]]:
        if not self.inflight:
            time.sleep(timeout)
            return []
        ready, _ = ray.wait(list(self.inflight), num_returns=len(self.inflight), timeout=timeout)
        out = []
        for ref in ready:
            item, w, worker, name = self.inflight.pop(ref)
            try:
                traj, lost = ray.get(ref)
            except LOST as e:  # the rollout worker died: replace it (once, for all its lost episodes)
                traj, lost = None, f"rollout worker lost: {type(e).__name__}"
                if self.workers[w] is worker:
                    self.workers[w] = self._new_worker(self.per_actor)
            if lost is not None and name in self.engines and not self._alive(self.engines[name]):
                self.engines.pop(name)
                self._busy_lost += self._last_busy.pop(name, 0.0)
            out.append((item, traj, lost))
        return out

    def _alive(self, engine) -> bool:
        try:
            ray.get(engine.info.remote(), timeout=30)
            return True
        except LOST + (ray.exceptions.GetTimeoutError,):
            return False

    # ---- training and weights --------------------------------------------------------------

    def train(self, samples: list[Sample]) -> dict:
        row = ray.get(self.trainer.step.remote(samples))
        self._version = row["version"]
        self._publish()
        return row

    def _publish(self) -> None:
        self.snapshot = self.trainer.snapshot.remote()  # one object; every engine pulls the same one
        self._updates = [e.update.remote(self._version, self.snapshot) for e in self.engines.values()]
        self.bytes_synced += self.snapshot_nbytes * len(self.engines)

    def wait_synced(self) -> None:
        for ref in self._updates:
            try:
                ray.get(ref)
            except LOST:
                pass  # an engine that left needs no weights

    @property
    def version(self) -> int:
        return self._version

    def state_dict(self) -> dict:
        return ray.get(self.trainer.state_dict.remote())

    def load_state_dict(self, state: dict) -> None:
        ray.get(self.trainer.load_state_dict.remote(state))
        self._version = state["version"]
        self._publish()
        self.wait_synced()

    def engine_busy_s(self) -> float:
        for name, e in list(self.engines.items()):
            try:
                self._last_busy[name] = ray.get(e.info.remote(), timeout=30)["busy_s"]
            except LOST + (ray.exceptions.GetTimeoutError,):
                pass
        # engines that left keep their busy seconds; divided by the configured engine count
        return (sum(self._last_busy.values()) + self._busy_lost) / self.cfg.rollout.engines

    def close(self) -> None:
        for actor in [self.trainer, *self.engines.values(), *self.workers]:
            ray.kill(actor)


def start_ray(cfg: Config, policy_dir: str, tasks: dict[str, Task], replay_ctx, *, address: str | None = None,
              cpus: CpuSplit | None = None) -> RayRuntime:
    if not ray.is_initialized():
        if address:
            ray.init(address=address)
        else:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    return RayRuntime(cfg, policy_dir, tasks, replay_ctx, cpus=cpus)
