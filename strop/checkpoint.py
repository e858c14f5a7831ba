"""Resumable checkpoints, one layout for every loop that resumes (mid-training, RL).

A checkpoint is a directory holding a JSON state (plain data: the step, counters, positions) and
the trainer's files: its model and optimizer as a torch distributed checkpoint in `shards/` (each
rank of a sharded trainer writes the shards it holds, `__<rank>_0.distcp`, and rank 0 the manifest,
`.metadata`; one process writes one file) and `trainer.pt` (the other torch objects: scheduler,
RNG states, version). Nothing is gathered to write it, and it loads at any number of ranks: each
rank reads the parts of the saved shards that it holds now.

It is written through `strop.outputs.atomic_dir`, so a kill at any moment leaves the previous
checkpoint or this one, whole, at `path` or (a kill between its two renames) at `path.old`, where
`find_checkpoint` looks too; the JSON state is written last, after every rank's shards.
`save_training` / `load_training` are that layout for mid-training's model, optimizer and
scheduler; the RL trainer writes its part with `save_sharded` into the directory the
orchestrator's `save_checkpoint` makes.
"""

import json
import random
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from strop.outputs import atomic_dir
from strop.train.parallel import Ranks

TRAINER, STATE, SHARDS = "trainer.pt", "state.json", "shards"


def save_checkpoint(path: Path, state: dict, write: Callable[[Path], None], state_name: str = STATE) -> None:
    """Replace the checkpoint at `path` whole: `write(tmp)` fills the new directory with the
    trainer's files (every rank's, when it returns), then `state` goes in as JSON in `state_name`."""
    with atomic_dir(Path(path)) as tmp:
        write(tmp)
        (tmp / state_name).write_text(json.dumps(state))


def find_checkpoint(path: Path, state_name: str = STATE) -> Path | None:
    """The whole checkpoint at `path`, else at `path.old` (a kill between atomic_dir's renames), else None."""
    path = Path(path)
    return next((d for d in (path, path.with_name(path.name + ".old")) if (d / state_name).is_file()), None)


def load_state(ckpt: Path, state_name: str = STATE) -> dict:
    """The JSON state saved by `save_checkpoint` in `ckpt` (see `find_checkpoint`)."""
    return json.loads((ckpt / state_name).read_text())


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
