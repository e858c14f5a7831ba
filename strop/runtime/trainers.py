"""The trainer as a runtime hosts it. Each publishes every version itself, through its own
`TrainerSync` (the delta is encoded in the trainer's process, stored and served by its origin):

- `LocalTrainer`: in the calling process (one core, tests; the Ray trainer actor holds one).
- `TrainerProcess`: a `LocalTrainer` in a spawned child process, the same calls over a pipe.
  Weights never cross the pipe (the trainer writes its checkpoints itself): what comes back is metrics rows, and
  `reply_bytes` counts it per call.

With `trainer.parallel.fsdp = N > 1`, `start_trainer` makes either of them rank 0 of N sharded
ranks (`strop.runtime.ranks`): the other N - 1 are worker processes it starts. Every rank then
publishes its own shards of each version (`TrainerSync.publish_shards`); rank 0 serves them.
"""

import multiprocessing
import pickle
import signal
from collections import Counter
from pathlib import Path

import torch

from strop.config import Config
from strop.rl.advantages import Sample
from strop.rl.trainer import RLTrainer
from strop.sync.publisher import TrainerSync
from strop.threads import child_environment

STOP_GRACE_S = 30.0  # a trainer process that has not exited this long after it was told to is killed


def trainer_sync(cfg: Config, store_url: str, host: str = "127.0.0.1", ranks=None) -> TrainerSync:
    """The trainer's end of the weight transport, as `[sync]` configures it (`ranks`: this rank's
    group, when a sharded trainer's ranks each publish their shards)."""
    s = cfg.sync
    return TrainerSync(
        store_url,
        full=s.type == "full",
        keep_deltas=s.keep_deltas,
        wan_bytes_per_s=s.wan_mb_s * 1e6 or None,
        host=host,
        ranks=ranks,
    )


def rank_trainer(
    ranks, cfg: Config, policy_dir: str, replay_ctx, pad_id: int, store_url: str, host: str = "127.0.0.1"
) -> "LocalTrainer":
    """This rank's trainer on its device (`ranks.device`): the policy, sharded over `ranks` when
    there are several, each rank publishing its shards (rank 0 serves them, at `host`); rank 0 also
    puts the policy's config and tokenizer into the store, for engines that start without the policy."""
    from strop.engine.bootstrap import publish_policy_files
    from strop.train.device import Precision
    from strop.train.shard_load import load_policy

    checkpointing = cfg.trainer.activation_checkpointing
    model = load_policy(
        policy_dir, ranks, checkpointing, cfg.trainer.frozen_layers
    ).float()  # sharded: built on meta, each rank reads its shards
    # The reference is the warm start on a resumed run too: `policy_dir` stays the run's `--policy`.
    reference = load_policy(policy_dir, ranks) if cfg.rl.ref_kl_coef > 0 else None
    sync = trainer_sync(cfg, store_url, host, ranks=ranks if ranks.size > 1 else None)
    if ranks.rank == 0:
        publish_policy_files(sync.publisher.store, policy_dir)
    trainer = RLTrainer(
        model,
        cfg.rl,
        pad_id=pad_id,
        replay_ctx=replay_ctx,
        ranks=ranks,
        reference=reference,
        precision=Precision.of(cfg.trainer, ranks.device.type),
    )
    return LocalTrainer(trainer, sync)


def start_trainer(cfg: Config, policy_dir: str, replay_ctx, pad_id: int, store_url: str):
    """The trainer in this process: a `LocalTrainer`, or rank 0 of `trainer.parallel.fsdp` ranks
    (a `RankedTrainer` with the same calls; the others run in worker processes, one thread each),
    on the device `trainer.device` picks (one GPU a rank)."""
    from strop.runtime.ranks import RankedTrainer, follow_calls
    from strop.train.device import device_type, rank_device
    from strop.train.parallel import Ranks, start_ranks

    args = (cfg, policy_dir, replay_ctx, pad_id, store_url)
    kind = device_type(cfg.trainer)
    n = cfg.trainer.parallel.fsdp
    if n == 1:
        return rank_trainer(Ranks(device=rank_device(kind)), *args)
    ranks, procs = start_ranks(n, follow_calls, (rank_trainer, args), kind=kind)
    return RankedTrainer(rank_trainer(ranks, *args), ranks, procs)


class LocalTrainer:
    """An `RLTrainer` publishing through `sync`, with the calls a runtime makes."""

    def __init__(self, trainer: RLTrainer, sync: TrainerSync):
        self.trainer, self.sync, self.origin_url = trainer, sync, sync.origin_url
        trainer.publish = sync.publish
        if sync.ranks is not None:
            trainer.publish_shards = sync.publish_shards

    @property
    def version(self) -> int:
        return self.trainer.version

    def step(self, samples: list[Sample]) -> dict:
        """One optimizer step; the new version is published before this returns."""
        return self.trainer.step(samples)

    def publish(self) -> None:
        """Publish the current weights (the first version a runtime starts from)."""
        self.trainer.publish_version()

    def state_dict(self) -> dict:
        return self.trainer.state_dict()

    def save(self, path: Path) -> None:
        """This trainer's part of a checkpoint, into the directory `path`."""
        self.trainer.save(path)

    def load(self, path: Path) -> None:
        """Load the trainer state `save` wrote in `path` and publish its weights as the start of a new chain."""
        self.trainer.load(path)
        self.sync.restart()
        self.publish()

    def bf16_state_dict(self) -> dict[str, torch.Tensor]:
        return self.trainer.bf16_state_dict()

    def memory(self) -> list[dict]:
        return self.trainer.memory()

    def sync_stats(self) -> dict:
        return self.sync.stats()

    def close(self) -> None:
        self.sync.close()


def _trainer_main(
    conn, cfg: Config, policy_dir: str, replay_ctx, pad_id: int, cpus: frozenset[int] | None, store_url: str
) -> None:
    """The child process of `TrainerProcess`: a `LocalTrainer` answering (method, arguments) messages,
    with one torch thread per core it may use."""
    from strop.gc_freeze import freeze_long_lived
    from strop.lifetime import exit_with_parent
    from strop.memory import retain_freed_memory
    from strop.runtime.cpus import pin
    from strop.threads import set_threads

    # The parent decides when this process ends (`TrainerProcess.close`), or dies and takes it along:
    # a Ctrl-C reaches the whole terminal's process group, and would only print a second traceback here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    set_threads(len(cpus) if cpus else 1)
    pin(cpus)
    # A step allocates and frees the same activations every time; handed back to the kernel
    # between steps, they are faulted in afresh on the next (and in a VM, freed pages idle for a
    # second or two are returned to the host, which makes those faults slow): keep them.
    retain_freed_memory()
    local = start_trainer(cfg, policy_dir, replay_ctx, pad_id, store_url)
    freeze_long_lived()
    _send(conn, local.origin_url)
    try:
        while (msg := pickle.loads(conn.recv_bytes())) is not None:
            call, args = msg
            _send(conn, (getattr(local, call)(*args), local.version))
    finally:
        local.close()


def _send(conn, obj) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class TrainerProcess:
    """A `LocalTrainer` in a child process (spawned, pinned to `cpus`, one torch thread per core),
    with the same calls.

    Its OpenMP threads wait passively (they sleep at a barrier instead of spinning): where the
    trainer shares its cores with engines, a spinning thread holds a core an engine needs while its
    partner is descheduled, and a 2-thread step took 2.7x as long beside one busy core as alone
    (passively: 1.6x, and no slower alone)."""

    def __init__(
        self, cfg: Config, policy_dir: str, replay_ctx, pad_id: int, cpus: frozenset[int] | None, store_url: str
    ):
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs torch threads
        self.conn, child = ctx.Pipe()
        # not a daemon, so it can start the ranks of a sharded trainer; it ends when the pipe closes
        self.proc = ctx.Process(
            target=_trainer_main,
            args=(child, cfg, policy_dir, replay_ctx, pad_id, cpus, store_url),
            name="strop-trainer",
        )
        with child_environment(OMP_WAIT_POLICY="PASSIVE"):
            self.proc.start()
        child.close()  # the child's end lives in the child alone, so its death reads as EOF here, not a hang
        self._in_call: str | None = None  # the call whose reply this process waits for
        self.origin_url = pickle.loads(self._recv())
        self.version = 0
        self.reply_bytes: Counter = Counter()  # call -> bytes that came back over the pipe

    def _recv(self) -> bytes:
        try:
            return self.conn.recv_bytes()
        except EOFError:
            self.proc.join(timeout=10)
            raise RuntimeError(
                f"the trainer process exited (exit code {self.proc.exitcode}); its error is printed above"
            ) from None

    def _call(self, call: str, *args):
        self._in_call = call
        try:
            _send(self.conn, (call, args))
        except (OSError, ValueError) as e:  # the child is gone (closed or dead) while the request was sent
            raise RuntimeError(f"the trainer process is gone (exit code {self.proc.exitcode}): {e}") from None
        data = self._recv()
        self._in_call = None
        self.reply_bytes[call] += len(data)
        result, self.version = pickle.loads(data)
        return result

    def step(self, samples: list[Sample]) -> dict:
        return self._call("step", samples)

    def publish(self) -> None:
        self._call("publish")

    def state_dict(self) -> dict:
        return self._call("state_dict")

    def save(self, path: Path) -> None:
        self._call("save", path)

    def load(self, path: Path) -> None:
        self._call("load", path)

    def bf16_state_dict(self) -> dict[str, torch.Tensor]:
        return self._call("bf16_state_dict")

    def sync_stats(self) -> dict:
        return self._call("sync_stats")

    def close(self) -> None:
        """End the child: after its loop's last message, or at once when a call was cut short (a
        signal or an error while this process waited for the reply; its result would be thrown away,
        and a step can take minutes). Killed if it has not exited `STOP_GRACE_S` later."""
        if self._in_call is None:
            try:
                _send(self.conn, None)
            except OSError:
                pass  # it has exited already
            self.proc.join(STOP_GRACE_S)
        if self.proc.exitcode is None:
            self.proc.terminate()  # checkpoints are written atomically: one cut short is simply absent
            self.proc.join(STOP_GRACE_S)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()
        if self._in_call is None:  # a call cut short still reads or writes it: its EOF or EPIPE ends that call
            self.conn.close()
