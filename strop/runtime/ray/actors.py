"""The `ray` runtime: the trainer's ranks, one relay per inference cluster, the engines and the
rollout workers as Ray actors, placed by node label (`strop.runtime.ray.placement`).

    trainer nodes (strop-role=trainer)          inference cluster "a" (strop-cluster=a)
    ┌──────────────────────────────┐  delta    ┌──────────────────────────────────────────┐
    │ TrainerRankActor ×fsdp:      │──once────►│ RelayActor ──► EngineActor ×N (+ replica) │
    │ RLTrainer shards, TrainerSync│  per      └──────────────────────────────────────────┘
    │ (rank 0 serves the origin)   │  cluster  ┌ cluster "b" ┐ ...
    └──────────────▲───────────────┘──────────►└─────────────┘
                   │ step(samples) → metrics          ▲ generate(ids)
    driver (orchestrator main loop) ── run(item) ──► RolloutActor ×2

Placement: the trainer's `trainer.parallel.fsdp` ranks are reserved together in a placement group
on the nodes labelled `strop-role=trainer` (a GPU each where those nodes have them;
`strop.runtime.ray.trainer`); each distinct value of the `strop-cluster` label is an inference
cluster, which gets one relay and a share of the engines (round robin), each placed by label
selector on that cluster's nodes. Without labels (a local Ray instance, which starts by itself:
2 CPUs, no dashboard) everything is one cluster on any node. Actors ask for no CPUs from Ray's
scheduler (their threads are pinned by `cpus`, when given, as in the inline runtime), so a small
machine can hold them all. Every actor process calls `set_threads` first.

Only the trainer nodes read the policy directory (and the run directory, for checkpoints). Every
other actor starts from the weight store: the trainer puts the policy's config and tokenizer
there beside the weights, and an engine — strop's, or a vLLM server it starts on its node —
builds the policy from those and fetches the weights (`strop.engine.bootstrap`).

Weights take the one transport of `strop.sync`: each trainer rank encodes the delta of its shards
of each version and publishes it to the store (`store_url`, which every inference node must be
able to read: a shared directory, or object storage on a real cluster), rank 0's origin announces
it; each relay pulls it once and serves its cluster; each engine's sync thread verifies it and
patches the engine in place. Nothing but metrics comes back from a step. `bytes_synced` is the
origin's egress.

Engines may join (`add_engine`: it fetches from the store what it needs, then the chain, and takes
work once current) and leave (`remove_engine`, or die) while the run goes on. Work on a lost
engine or worker comes back as lost (`results`); the orchestrator relaunches it under the same key
and `submit` sends it to a live engine — a dead rollout worker is replaced. A lost trainer rank
stops the run (`strop.errors.RunStopped`); its last checkpoint resumes it.
"""

import os
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import ray

from strop.config import Config, RolloutSection
from strop.env.harness.loop import HarnessConfig, harness_config
from strop.env.task import Task
from strop.policy_api import Generation, SamplingParams
from strop.rl.advantages import Sample
from strop.rl.rollout import RolloutLost, WorkItem
from strop.rl.trajectory import Trajectory
from strop.runtime.cpus import CpuSplit
from strop.runtime.engines import VLLM_START_TIMEOUT_S, summed_stats
from strop.runtime.inline import SYNC_TIMEOUT_S
from strop.runtime.ray.placement import cluster_layout, engine_resources, on_cluster, start_actor_process
from strop.runtime.ray.relay import RelayActor
from strop.runtime.ray.trainer import RayTrainer
from strop.runtime.weights import relay_keep, sync_seconds

ROLLOUT_ACTORS = 2  # rollout processes; each runs ceil(workers / ROLLOUT_ACTORS) episodes on threads
LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
CLOSE_TIMEOUT_S = 60.0  # an engine that has not stopped its server by then is killed with it
ENGINE_START_TIMEOUT_S = VLLM_START_TIMEOUT_S + SYNC_TIMEOUT_S  # placed, started and current by then, or never


@ray.remote(num_cpus=0, max_concurrency=64)
class EngineActor:
    """One engine (`rollout.engine`: strop's, with its loop thread batching the turns of every
    rollout thread calling `generate`; or a vLLM server it starts on this node) and its sync
    thread. It starts from the weight store alone: this node needs no copy of the policy."""

    def __init__(
        self,
        cfg: Config,
        index: int,
        label: str,
        cpus: frozenset[int] | None,
        store_url: str,
        relay_url: str,
        origin_url: str,
    ):
        start_actor_process(cpus)
        from strop.runtime.engines import start_engine
        from strop.sync.relay import http_link

        self.label = label
        self.workdir = Path(tempfile.mkdtemp(prefix="strop-engine-"))  # the policy's files, fetched from the store
        self.engine = start_engine(
            cfg, index, None, None, store_url, http_link(relay_url), origin_url, cpus, workdir=self.workdir
        )

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        return self.engine.policy().generate(prompt_ids, params)

    def wait_version(self, version: int, timeout: float = SYNC_TIMEOUT_S) -> bool:
        return self.engine.wait_version(version, timeout)

    def info(self) -> dict:
        s = self.engine.sync
        with s.cond:  # swaps: (version, pause seconds, time.time() it went live), the first one the bootstrap
            swaps = [(v, pause, at) for (v, at), pause in zip(s.swapped_at.items(), s.pauses)]
            first = s.reports[0] if s.reports else None
        return {
            "label": self.label,
            "version": s.version,
            "stats": self.engine.stats(),
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "swaps": swaps,
            # what its first sync fetched whole: the weights it did not start with
            "bootstrap": {
                "fetched": len(first.repaired) if first else 0,
                "bytes": first.repaired_bytes if first else 0,
            },
            "repaired": [x for rep in s.reports for x in rep.repaired],
            "repaired_bytes": sum(rep.repaired_bytes for rep in s.reports),
        }

    def weights_crc32(self) -> dict[str, int]:
        """CRC-32C of each live tensor as fp32 (as it is, or widened from bf16: both exact), so a
        live weight that is not exactly the trainer's bf16 value shows."""
        from strop.sync.apply import bits_view

        return {k: bits_view(t.detach().float()).crc32() for k, t in self.engine.sync.live.items()}

    def close(self) -> None:
        """Stop following the relay and stop the engine (and the server it started)."""
        self.engine.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


class RayPolicy:
    """A `PolicyClient` over an `EngineActor` handle; a dead engine raises (-> RolloutLost)."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        return ray.get(self.engine.generate.remote(prompt_ids, params))


@ray.remote(num_cpus=0, max_concurrency=64)
class RolloutActor:
    def __init__(self, r: RolloutSection, harness: HarnessConfig, store_url: str, cpus: frozenset[int] | None):
        start_actor_process(cpus)
        from strop.data.tokenizer import load_tokenizer
        from strop.engine.bootstrap import policy_files
        from strop.env.harness.loop import Harness
        from strop.rl.rollout import sandbox_limits

        with tempfile.TemporaryDirectory(prefix="strop-rollout-") as tmp:  # the tokenizer, from the store
            tokenizer = load_tokenizer(policy_files(store_url, Path(tmp)))
        self.harness = Harness(tokenizer, harness)
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
    def __init__(
        self,
        cfg: Config,
        policy_dir: str,
        tasks: dict[str, Task],
        replay_ctx,
        *,
        cpus: CpuSplit | None = None,
        rollout_actors: int = ROLLOUT_ACTORS,
        store_url: str | None = None,
    ):
        from strop.data.tokenizer import load_tokenizer

        self.cfg, self.policy_dir, self.tasks = cfg, policy_dir, tasks
        self.cpus = cpus
        self.tokenizer = load_tokenizer(policy_dir)
        self._tmp = None if store_url else tempfile.TemporaryDirectory(prefix="strop-weights-")
        self.store_url = store_url or self._tmp.name
        _, self.clusters = cluster_layout()
        self.trainer = RayTrainer(
            cfg,
            policy_dir,
            replay_ctx,
            self.tokenizer.pad_token_id or 0,
            self.store_url,
            cpus.trainer if cpus else None,
        )
        self.trainer.publish()  # version 0: the store's snapshot (and the policy's files beside it)
        self.origin_url = self.trainer.origin_url
        lan = cfg.sync.lan_mb_s * 1e6 or None
        self.relays = {
            c: RelayActor.options(**on_cluster(c)).remote(self.origin_url, lan, relay_keep(cfg)) for c in self.clusters
        }
        self.relay_urls = {c: ray.get(a.url.remote()) for c, a in self.relays.items()}
        self._version = 0
        self.engines: dict[str, object] = {}  # name -> handle, live engines only
        self.engine_cluster: dict[str, str] = {}
        self._engine_seq = 0
        for i in range(cfg.rollout.engines):
            self.add_engine(self.clusters[i % len(self.clusters)])
        per_actor = -(-cfg.rollout.workers // rollout_actors)
        self.workers = [self._new_worker(per_actor) for _ in range(rollout_actors)]
        self.per_actor = per_actor
        self.inflight: dict = {}  # object ref -> (item, worker index, worker handle, engine name)
        self._stats_lost: Counter = Counter()  # figures of engines that left
        self._last_stats: dict[str, dict] = {}
        self._next = 0

    def _new_worker(self, concurrency: int):
        return RolloutActor.options(max_concurrency=concurrency).remote(
            self.cfg.rollout,
            harness_config(self.cfg.rollout, self.cfg.harness),
            self.store_url,
            self.cpus.rollout if self.cpus else None,
        )

    # ---- engines joining and leaving -------------------------------------------------------

    def add_engine(self, cluster: str) -> str:
        """Start an engine in `cluster`; it catches up from the store and its cluster's relay, and
        takes work from the next `submit` on."""
        name = f"engine-{self._engine_seq}"
        self._engine_seq += 1
        engine = EngineActor.options(**on_cluster(cluster), **engine_resources(self.cfg.rollout, cluster)).remote(
            self.cfg,
            self._engine_seq,
            cluster,
            self.cpus.rollout if self.cpus else None,
            self.store_url,
            self.relay_urls[cluster],
            self.origin_url,
        )
        try:  # placed, started (a vLLM server takes minutes on a CPU) and synced, or a clear error
            synced = ray.get(engine.wait_version.remote(self._version), timeout=ENGINE_START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.kill(engine)
            raise RuntimeError(
                f"{name} did not start in cluster {cluster!r} in {ENGINE_START_TIMEOUT_S:.0f} s "
                f"(asking for {engine_resources(self.cfg.rollout, cluster) or 'no resources'})"
            ) from None
        if not synced:
            raise RuntimeError(f"{name} did not reach version {self._version} in {SYNC_TIMEOUT_S:.0f} s")
        self.engines[name] = engine
        self.engine_cluster[name] = cluster
        return name

    def remove_engine(self, name: str) -> None:
        """Take an engine away (its in-flight work comes back lost and is relaunched elsewhere)."""
        engine = self.engines.pop(name)
        self._stats_lost.update(self._last_stats.pop(name, {}))
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
                self._stats_lost.update(self._last_stats.pop(name, {}))
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
        """One trainer step; the trainer actor publishes the new version itself."""
        row = self.trainer.step(samples)
        self._version = row["version"]
        return row

    def wait_synced(self) -> None:
        """Block until every live engine serves the last published version."""
        refs = {name: e.wait_version.remote(self._version) for name, e in self.engines.items()}
        for name, ref in refs.items():
            try:
                if not ray.get(ref):
                    raise RuntimeError(f"{name} did not reach version {self._version} in {SYNC_TIMEOUT_S:.0f} s")
            except LOST:
                pass  # an engine that left needs no weights

    def sync_stats(self) -> dict:
        return self.trainer.sync_stats()

    @property
    def bytes_synced(self) -> int:
        """Bytes that left the trainer for the relays (its origin's egress)."""
        return self.sync_stats()["bytes_sent"]

    @property
    def version(self) -> int:
        return self._version

    def state_dict(self) -> dict:
        return self.trainer.state_dict()

    def save(self, path) -> None:
        """Every trainer rank writes its shards into `path` itself: a directory every trainer node
        reaches (the local node here; a shared file system across nodes)."""
        self.trainer.save(path)

    def load(self, path) -> None:
        self.trainer.load(path)  # published as a new chain
        self._version = self.trainer.version
        self.wait_synced()

    def sync_seconds(self) -> dict[int, float]:
        """Per version: seconds from its publication to the last live engine serving it (`sync_seconds`),
        once every engine serves the last one."""
        self.wait_synced()
        swapped = [{v: at for v, _, at in ray.get(e.info.remote(), timeout=30)["swaps"]} for e in self.engines.values()]
        return sync_seconds(self.trainer.sync_stats()["published_at"], swapped)

    def cpu_seconds(self) -> dict[str, float]:
        """Nothing: the trainer and engines are actors on other nodes' cores, not this process's."""
        return {}

    def engine_stats(self) -> dict:
        """The engines' figures (`RunEngine.stats`) summed, those that left included, and `engines`,
        the configured count."""
        for name, e in list(self.engines.items()):
            try:
                self._last_stats[name] = ray.get(e.info.remote(), timeout=30)["stats"]
            except LOST + (ray.exceptions.GetTimeoutError,):
                pass
        return {**summed_stats([*self._last_stats.values(), self._stats_lost]), "engines": self.cfg.rollout.engines}

    def placement(self) -> dict:
        """Where Ray placed the run's actors (node ids from each actor's own runtime context): the
        trainer ranks (with their devices), each cluster's relay, and each live engine with what its
        first sync fetched from the store."""
        relays = {c: ray.get(a.stats.remote())["node"] for c, a in self.relays.items()}
        engines = {}
        for name, e in sorted(self.engines.items()):
            info = ray.get(e.info.remote(), timeout=30)
            engines[name] = {"cluster": info["label"], "node": info["node"], "bootstrap": info["bootstrap"]}
        return {"trainer_ranks": self.trainer.placement, "relays": relays, "engines": engines}

    def close(self) -> None:
        # engines first, each stopping the server it may have started (a killed actor leaves it behind)
        refs = [e.close.remote() for e in self.engines.values()]
        ray.wait(refs, num_returns=len(refs), timeout=CLOSE_TIMEOUT_S)
        for actor in [*self.engines.values(), *self.workers, *self.relays.values()]:
            ray.kill(actor)
        self.trainer.close()
        if self._tmp is not None:
            self._tmp.cleanup()


def start_ray(
    cfg: Config,
    policy_dir: str,
    tasks: dict[str, Task],
    replay_ctx,
    *,
    address: str | None = None,
    cpus: CpuSplit | None = None,
    store_url: str | None = None,
    rollout_actors: int = ROLLOUT_ACTORS,
) -> RayRuntime:
    """`store_url`: the versioned weight store, readable from every inference node (default: a
    temporary directory on this machine, removed at close)."""
    if not ray.is_initialized():
        if address:
            ray.init(address=address)
        else:
            # "local": a new instance, even where `ray start` left a cluster running on this machine
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    return RayRuntime(cfg, policy_dir, tasks, replay_ctx, cpus=cpus, rollout_actors=rollout_actors, store_url=store_url)
