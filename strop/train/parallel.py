"""Data-parallel training over ranks with torch's FSDP2: a trainer's view of its rank group.

A trainer (`strop.rl.trainer.RLTrainer`) runs the same code on every rank; what differs is the
`Ranks` it is given:

- `Ranks()` is one process: every collective is the identity, so the single-process trainer is
  this code with N = 1.
- `Ranks(rank, size, mesh)` is rank `rank` of a process group (`join`): the model is sharded over
  `mesh` by `shard_model`, so each rank holds 1/N of the parameters, gradients and AdamW state,
  and each step's micro-batches are dealt out between the ranks (`share`).

Each rank computes on its `device` (`strop.train.device`: the CPU, or a GPU of its own), and the
process group's backend follows it: gloo for CPU ranks, NCCL (with gloo for pickled objects) for
GPU ranks. The ranks are local processes (`start_ranks`) or Ray actors on trainer nodes
(`strop.runtime.ray.trainer`); either way they rendezvous with `join`.

The maths is the single-process trainer's: the micro-batches are the same, a micro-batch's loss
already carries the batch's normalisation (losses add up), and FSDP sums the ranks' gradients
(divide factor 1) where one process accumulates them. Only the order of those additions and of
the gradient norm's reduction differs, so two ranks with one micro-batch each and an inactive
clip give bitwise the single process's weights, and otherwise agree to float32 rounding.

Every forward and backward of a sharded model runs collectives (all-gather, reduce-scatter), so
every rank must run as many of them per step: `share` pads a rank that has fewer micro-batches
with copies that weigh nothing. A `replay_ctx` must decide the same way for such a copy as for
the micro-batch it copies (router replay does: it looks at the batch's recorded routing).
"""

import multiprocessing
import os
import socket
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class Ranks:
    """This process's place in the trainer's rank group, and the collectives a step needs."""

    def __init__(self, rank: int = 0, size: int = 1, mesh=None, device: torch.device | str = "cpu"):
        assert 0 <= rank < size and (size == 1 or mesh is not None), "a rank group of several needs a device mesh"
        self.rank, self.size, self.mesh = rank, size, mesh
        self.device = torch.device(device)  # where this rank's model and batches live

    def share(self, chunks: list[T], null: Callable[[T], T]) -> list[tuple[T, bool]]:
        """This rank's chunks (every size-th, from its rank on) as (chunk, counted) pairs, padded
        with uncounted `null(chunks[0])` copies to as many chunks as the busiest rank has."""
        if not chunks:
            return []
        mine = [(c, True) for c in chunks[self.rank :: self.size]]
        per_rank = -(-len(chunks) // self.size)
        return mine + [(null(chunks[0]), False)] * (per_rank - len(mine))

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj=None):
        """Rank 0's `obj` on every rank (what the other ranks pass is ignored)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (on this rank's device) summed over the ranks (a new tensor, no gradient), on every rank."""
        if self.size == 1:
            return t.detach()
        out = t.detach().clone()
        dist.all_reduce(out)
        return out


def whole(t: torch.Tensor) -> torch.Tensor:
    """The full tensor behind a sharded one (a collective: every rank calls it, in the same order);
    a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (a plain tensor is all of itself)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def shard_offset(t: torch.Tensor) -> int:
    """Where this rank's shard of `t` (`local(t)`) starts in the whole tensor, in flat elements: FSDP2
    shards along dim 0 as `torch.chunk` does (ceil(rows / N) rows a rank; the last ones short or
    empty), so a shard is one contiguous range. A plain tensor starts at 0."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return 0
    assert tuple(t.placements) == (Shard(0),), f"a shard along dim 0 expected, not {t.placements}"
    rows, size = t.shape[0], t.device_mesh.size()
    per = -(-rows // size)
    start = min(t.device_mesh.get_local_rank() * per, rows)
    assert t.to_local().shape[0] == min(per, rows - start), "FSDP's shard is not torch.chunk's"
    return start * (t.numel() // rows if rows else 0)


def shard_model(model, mesh) -> None:
    """Shard a Hugging Face causal LM over the 1-D `mesh` in place, bottom-up (torchtitan's order):

    1. each decoder layer is one FSDP group (its parameters are gathered just for its forward and
       backward; MoE experts shard along the expert dimension like any parameter);
    2. the embedding, final norm and output head are one group: the head is tied to the embedding,
       and `strop.model.policy.logits_at` calls it after the decoder's forward, not inside it;
    3. the decoder is the root, so each forward starts and each backward ends there.

    Gradients are summed over the ranks, not averaged: the losses carry their normalisation.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    decoder = model.get_decoder()
    records = _CAN_RECORD_REGISTRY.get(decoder)
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard([decoder.embed_tokens, decoder.norm, model.get_output_embeddings()], mesh=mesh)
    fully_shard(decoder, mesh=mesh)
    # fully_shard gives the decoder a new class (FSDP<name>); transformers looks up which outputs
    # (router logits) a decoder can record by its class name, so the new one records what the old did
    _CAN_RECORD_REGISTRY[decoder] = records
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now at `host` (for the process group's rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join(rank: int, size: int, address: str, kind: str = "cpu") -> Ranks:
    """Join the trainer's process group as `rank` of `size` (rendezvous at `address`, host:port) on
    `kind` devices ("cpu": gloo; "cuda": a GPU of this machine, NCCL) and build its 1-D device mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from strop.train.device import backend, rank_device

    device = rank_device(kind, rank)
    host, port = address.rsplit(":", 1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, port
    dist.init_process_group(backend(kind), rank=rank, world_size=size)
    return Ranks(rank, size, init_device_mesh(kind, (size,)), device)


def leave() -> None:
    """Leave the process group (a no-op outside one)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _rank_main(rank: int, size: int, address: str, kind: str, threads: int, target: Callable, args: tuple) -> None:
    """A worker rank: `threads` torch threads, the process group, then `target(ranks, *args)`; it ends
    with the process that started it."""
    from strop.lifetime import exit_with_parent
    from strop.threads import set_threads

    exit_with_parent()
    set_threads(threads)
    ranks = join(rank, size, address, kind)
    try:
        target(ranks, *args)
    finally:
        leave()


def start_ranks(size: int, target: Callable, args: tuple, threads: int = 1, kind: str = "cpu") -> tuple[Ranks, list]:
    """Spawn ranks 1..size-1 (each sets `threads` torch threads and runs `target(ranks, *args)`),
    join as rank 0; every rank on a `kind` device ("cuda": rank r on this machine's GPU r).
    Returns rank 0's group and the worker processes."""
    address = f"127.0.0.1:{free_port()}"
    ctx = multiprocessing.get_context("spawn")  # never fork a process that runs torch threads
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, size, address, kind, threads, target, args),
            name=f"strop-rank-{r}",
            daemon=True,
        )
        for r in range(1, size)
    ]
    for p in procs:
        p.start()
    return join(0, size, address, kind), procs


def stop_ranks(procs: list) -> None:
    """After the workers' last collective: wait for them to end, and leave the group."""
    for p in procs:
        p.join(timeout=60)
    leave()
