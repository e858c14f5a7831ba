"""The trainer cluster on Ray: `trainer.parallel.fsdp` rank actors on the trainer nodes, one
sharded RL trainer between them.

    driver ──call──► rank 0 ─┐
           ──call──► rank 1 ─┼─ process group (gloo on CPU, NCCL on GPUs): FSDP2's all-gathers and
           ──call──► ...    ─┘  reduce-scatters, the metrics' gathers
                     each rank publishes its own shards of every version; rank 0 serves them

The ranks are reserved together in a placement group on the trainer nodes (a GPU each where the
nodes have them; `strop.runtime.ray.placement`), rendezvous at rank 0's node, and each builds its
trainer with `strop.runtime.trainers.rank_trainer`, the code a local rank runs. `RayTrainer` has
`LocalTrainer`'s calls: each is sent to every rank at once (samples go into Ray's object store
once, and every rank reads them), so the collectives inside line up, and rank 0's answer comes
back. Weights never travel through the driver: each rank publishes its shards to the store.

The trainer is one indivisible cluster: a rank that dies (its process, its node) leaves the others
waiting in a collective, so the first lost rank stops the trainer — every rank actor is killed —
and the call raises `RunStopped`, one line naming the rank and its node. The run's last checkpoint
(written by every rank, loadable at any rank count) resumes it.
"""

import uuid

import ray

from strop.config import Config
from strop.errors import RunStopped, UserError, one_line
from strop.runtime.ray.placement import start_actor_process, trainer_placement

# a rank's process gone: killed, crashed, its node lost, or killed by Ray's memory monitor
LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.OutOfMemoryError)
NAMESPACE = "strop"  # rank actors are named in it (`strop-trainer-<id>-rank-<i>`), for operators and tests
FAILURE_GRACE_S = 5.0  # after one rank fails, how long the others' answers are awaited to find a lost one


@ray.remote(num_cpus=0)
class TrainerRankActor:
    """One rank of the trainer: joins the process group, builds its trainer, runs the driver's calls."""

    def __init__(self, cpus: frozenset[int] | None):
        start_actor_process(cpus)
        self.local = None

    def address(self) -> str:
        """A rendezvous address on this rank's node (rank 0's is the group's)."""
        from strop.train.parallel import free_port

        host = ray.util.get_node_ip_address()
        return f"{host}:{free_port(host)}"

    def start(self, rank: int, size: int, address: str, kind: str, cfg: Config, *args) -> dict:
        """Join the group as `rank` of `size` on `kind` devices and build this rank's trainer
        (`rank_trainer(ranks, cfg, *args)`); returns where it landed and rank 0's origin URL."""
        from strop.runtime.trainers import rank_trainer
        from strop.train.device import rank_device
        from strop.train.parallel import Ranks, join

        ranks = join(rank, size, address, kind) if size > 1 else Ranks(device=rank_device(kind))
        self.local = rank_trainer(ranks, cfg, *args, host=ray.util.get_node_ip_address())
        ctx = ray.get_runtime_context()
        return {
            "rank": rank,
            "node": ctx.get_node_id(),
            "device": str(ranks.device),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "origin_url": self.local.origin_url,
        }

    def call(self, name: str, *args) -> tuple:
        """(the trainer's answer to `name(*args)`, its version after it)."""
        return getattr(self.local, name)(*args), self.local.version

    def weights_crc32(self) -> dict[str, int]:
        """CRC-32C of each tensor of the current bf16 snapshot (gathered: every rank calls it),
        widened to fp32 (exact), to compare with the engines' live weights bit for bit."""
        from strop.sync.apply import bits_view

        return {k: bits_view(v.float()).crc32() for k, v in self.local.bf16_state_dict().items()}


class RayTrainer:
    """The trainer as `trainer.parallel.fsdp` rank actors (one is a one-process trainer), with the
    calls of `strop.runtime.trainers.LocalTrainer`. `placement`: where each rank landed (Ray's node
    id, device, GPU ids)."""

    def __init__(
        self, cfg: Config, policy_dir: str, replay_ctx, pad_id: int, store_url: str, cpus: frozenset[int] | None = None
    ):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n = cfg.trainer.parallel.fsdp
        self.pg, kind = trainer_placement(cfg.trainer, n)
        self.version, self.killed = 0, False
        name = f"strop-trainer-{uuid.uuid4().hex[:8]}"
        self.actors = [
            TrainerRankActor.options(
                name=f"{name}-rank-{i}",
                namespace=NAMESPACE,
                num_gpus=1 if kind == "cuda" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote(cpus)
            for i in range(n)
        ]
        self.placement: list[dict] = []  # filled once every rank has started
        address = self._wait([self.actors[0].address.remote()])[0]
        args = (policy_dir, replay_ctx, pad_id, store_url)
        self.placement = self._wait(
            [a.start.remote(i, n, address, kind, cfg, *args) for i, a in enumerate(self.actors)]
        )
        self.origin_url = self.placement[0].pop("origin_url")
        for p in self.placement[1:]:
            del p["origin_url"]

    def _wait(self, refs: list) -> list:
        """Every rank's answer, in rank order. The first failure stops the trainer: every rank is
        killed, and a lost rank raises `RunStopped`; an error raised by a rank's code is re-raised."""
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except Exception as first:  # noqa: BLE001 - a lost rank is told apart from a rank's own error below
                self._stop(refs, first)
        return ray.get(refs)

    def _stop(self, refs: list, first: Exception) -> None:
        ray.wait(refs, num_returns=len(refs), timeout=FAILURE_GRACE_S)  # a peer's failure may show first
        lost = []
        for rank, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0)
            except LOST as e:
                lost.append((rank, e))
            except Exception:  # noqa: BLE001 - a rank's own error, or one waiting for a lost peer
                pass
        self.kill()
        if not lost:
            if isinstance(getattr(first, "cause", None), UserError):
                raise first.cause from None  # a rank's one-line error, without Ray's remote traceback
            raise first
        rank, e = lost[0]
        where = self.placement[rank]["node"][:12] if len(self.placement) > rank else "its node"
        raise RunStopped(
            f"trainer rank {rank} of {len(self.actors)} (node {where}) was lost ({one_line(e)}); every rank is "
            "stopped: run the same command again to resume from the last checkpoint"
        ) from None

    def _all(self, call: str, *args):
        """`call` on every rank (its collectives line up), rank 0's answer."""
        answer, self.version = self._wait([a.call.remote(call, *args) for a in self.actors])[0]
        return answer

    def step(self, samples) -> dict:
        return self._all("step", ray.put(samples))  # into the object store once; every rank reads it

    def publish(self) -> None:
        self._all("publish")

    def state_dict(self) -> dict:
        return self._all("state_dict")

    def save(self, path) -> None:
        self._all("save", path)  # every rank writes its shards into `path`: a directory every trainer node reaches

    def load(self, path) -> None:
        self._all("load", path)

    def bf16_state_dict(self):
        return self._all("bf16_state_dict")

    def memory(self) -> list[dict]:
        return self._all("memory")

    def sync_stats(self) -> dict:
        return self._wait([self.actors[0].call.remote("sync_stats")])[0][0]  # rank 0's transport: no collective

    def weights_crc32(self) -> dict[str, int]:
        return self._wait([a.weights_crc32.remote() for a in self.actors])[0]

    def kill(self) -> None:
        """Kill every rank actor and release their placement."""
        from ray.util.placement_group import remove_placement_group

        if self.killed:
            return
        self.killed = True
        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self.pg)

    def close(self) -> None:
        """Stop every rank (its origin and process) and release their placement."""
        if not self.killed:
            try:
                self._wait([a.call.remote("close") for a in self.actors])
            except RunStopped:
                pass  # a rank was lost: the others are killed below
        self.kill()
