"""A policy loaded straight into its shards: built on the meta device, sharded over the ranks
(`strop.train.parallel.shard_model`), then each rank reads from the safetensors files only the
rows of each tensor that it holds. No rank ever holds the whole model (torchtitan's order: build
on meta, parallelize, materialise, load), and each rank's rows go straight to its device.

FSDP2 shards every parameter along its first dimension in `torch.chunk` pieces, so rank r of N
holds rows [r * c, (r + 1) * c) of a tensor of n rows, c = ceil(n / N). A fused expert tensor
(`<layer>.mlp.experts.gate_up_proj`, `down_proj`: transformers' live layout) is read from the
per-expert tensors on disk (`strop.model.checkpoint_names`) of the rank's experts only. Buffers
(rotary frequencies) are computed on the CPU as the model is built: they are not in a checkpoint.
"""

import contextlib
import json
from pathlib import Path

import torch

from strop.model.checkpoint_names import PROJECTIONS
from strop.model.meta import build_on_meta, materialize
from strop.train.parallel import Ranks, local, shard_model


def rows_of(n: int, ranks: Ranks) -> tuple[int, int]:
    """The rows [start, stop) of an n-row tensor that this rank holds under FSDP2's dim-0 sharding."""
    c = -(-n // ranks.size)
    start = min(ranks.rank * c, n)
    return start, min(start + c, n)


class CheckpointRows:
    """Row ranges of a model directory's tensors, under their live names, read lazily (safetensors
    slices: only the rows asked for are read)."""

    def __init__(self, path: Path, stack: contextlib.ExitStack):
        from safetensors import safe_open

        path = Path(path)
        index = path / "model.safetensors.index.json"
        files = (
            sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if index.is_file()
            else ["model.safetensors"]
        )
        self.where = {}
        for f in files:
            handle = stack.enter_context(safe_open(str(path / f), framework="pt"))
            self.where.update({name: handle for name in handle.keys()})

    def _rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.where[name].get_slice(name)[start:stop]

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the live tensor `name` (fp32)."""
        if name in self.where:
            return self._rows(name, start, stop).float()
        experts, _, fused = name.rpartition(".")
        assert fused in ("gate_up_proj", "down_proj"), f"{name} is not in the checkpoint"

        def expert(e: int, proj: str) -> torch.Tensor:
            t = f"{experts}.{e}.{proj}.weight"
            return self._rows(t, 0, self.where[t].get_slice(t).get_shape()[0])

        projs = PROJECTIONS[:2] if fused == "gate_up_proj" else PROJECTIONS[2:]
        return torch.stack([torch.cat([expert(e, p) for p in projs]) for e in range(start, stop)]).float()


def load_sharded_model(path: str | Path, ranks: Ranks, checkpointing: bool = False):
    """The policy saved in `path` (a Hugging Face model directory), sharded over `ranks` (several),
    each rank's parameters read from disk directly into its shards on its device; fp32.
    `checkpointing`: activation checkpointing, applied before sharding."""
    from transformers import AutoConfig

    from strop.train.device import checkpoint_activations

    model = build_on_meta(AutoConfig.from_pretrained(str(path)))
    if checkpointing:
        checkpoint_activations(model)
    shard_model(model, ranks.mesh)
    materialize(model, ranks.device)  # the shards' storage, uninitialised: filled next
    with torch.no_grad(), contextlib.ExitStack() as stack:
        rows = CheckpointRows(Path(path), stack)
        for name, p in model.named_parameters():  # a tied head is the embedding's parameter: read once
            shard = local(p)
            start, stop = rows_of(p.shape[0], ranks)
            assert shard.shape[0] == stop - start, (
                f"{name}: rank {ranks.rank} holds {shard.shape[0]} rows, not {stop - start}"
            )
            shard.copy_(rows.read(name, start, stop))
    return model


def load_policy(path: str | Path, ranks: Ranks, checkpointing: bool = False, frozen: float = 0.0):
    """The policy in `path` as a trainer on `ranks` holds it, on the ranks' device: whole in one
    process, else in its shards. `checkpointing`: with activation checkpointing; `frozen`: the
    fraction of its lower layers not trained (`strop.train.device.freeze_lower`)."""
    from strop.model.policy import load_model
    from strop.train.device import checkpoint_activations, freeze_lower

    if ranks.size > 1:
        model = load_sharded_model(path, ranks, checkpointing)
    else:
        model = load_model(path).to(ranks.device)
        if checkpointing:
            checkpoint_activations(model)
    freeze_lower(model, frozen)
    return model
