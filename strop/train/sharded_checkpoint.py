"""A trainer's part of a checkpoint (`strop.checkpoint`), written and read by every rank of its
rank group: the model and optimizer as a torch distributed checkpoint in `shards/` (each rank the
shards it holds, rank 0 the manifest) and rank 0's other torch objects in `trainer.pt`. Nothing is
gathered to write it, and it loads at any number of ranks. `save_training` / `load_training` are
that layout for mid-training's model, optimizer and scheduler; the RL trainer writes its part with
`save_sharded` into the directory the orchestrator's `save_checkpoint` makes.
"""

import random
import warnings
from pathlib import Path

import numpy as np
import torch

from strop.checkpoint import SHARDS, TRAINER, load_state, save_checkpoint
from strop.train.parallel import Ranks


def save_sharded(path: Path, model, optimizer, ranks: Ranks, extra: dict) -> None:
    """Every rank of `ranks` calls it: `model` and `optimizer` (sharded over the ranks or not) as a
    torch distributed checkpoint in `path/shards`, and rank 0's `extra` (torch objects) in
    `path/trainer.pt`. Returns on rank 0 once every rank's shards and the manifest are written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # one process: no_dist says so already
        dcp.save(
            {"model": model_state, "optimizer": optimizer_state},
            checkpoint_id=str(Path(path) / SHARDS),
            no_dist=ranks.size == 1,
        )
    if ranks.rank == 0:
        torch.save(extra, Path(path) / TRAINER)


def load_sharded(path: Path, model, optimizer, ranks: Ranks) -> dict:
    """Every rank: load what `save_sharded` wrote in `path` (at this or any other rank count) into
    `model` and `optimizer` as they are sharded now; returns the saved `extra`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)  # the layout to read into (optimizer state made)
    saved = {"model": model_state, "optimizer": optimizer_state}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(saved, checkpoint_id=str(Path(path) / SHARDS), no_dist=ranks.size == 1)
    set_state_dict(model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"])
    return torch.load(Path(path) / TRAINER, weights_only=False)


def save_training(path: Path, model, optimizer, scheduler, step: int, state: dict, ranks: Ranks | None = None) -> None:
    """A model trainer's checkpoint: model, optimizer, scheduler, rank 0's RNG states, and `state`
    with the step. Every rank of `ranks` calls it; rank 0 makes the directory and renames it."""
    ranks = ranks or Ranks()
    extra = {
        "scheduler": scheduler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
    }

    def write(tmp: Path | None) -> None:
        tmp = Path(ranks.broadcast(str(tmp)))  # rank 0's directory, made and empty before any rank writes
        save_sharded(tmp, model, optimizer, ranks, extra)

    if ranks.rank == 0:
        save_checkpoint(path, {"step": step, **state}, write)
    else:
        write(None)


def load_training(ckpt: Path, model, optimizer, scheduler, ranks: Ranks | None = None) -> dict:
    """Restore everything `save_training` saved in `ckpt`, at any number of ranks; returns its state (with "step")."""
    extra = load_sharded(ckpt, model, optimizer, ranks or Ranks())
    scheduler.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["rng"]["torch"])
    np.random.set_state(extra["rng"]["numpy"])
    random.setstate(extra["rng"]["python"])
    return load_state(ckpt)
