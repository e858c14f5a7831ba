"""Resumable checkpoints, one layout for every loop that resumes (mid-training, RL).

A checkpoint is a directory holding a JSON state (plain data: the step, counters, positions),
`trainer.pt` (torch objects: optimizer, scheduler, RNG states, a runtime's trainer) and, for a
model trainer, the weights as `model.safetensors`. It is written through
`strop.outputs.atomic_dir`, so a kill at any moment leaves the previous checkpoint or this one,
whole, at `path` or (a kill between its two renames) at `path.old`, where `find_checkpoint`
looks too. `save_training` / `load_training` are that layout for a model, its optimizer and its
scheduler with the process's RNG states.
"""

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from strop.outputs import atomic_dir

TRAINER, WEIGHTS, STATE = "trainer.pt", "model.safetensors", "state.json"


def save_checkpoint(path: Path, state: dict, trainer: dict, weights: dict[str, torch.Tensor] | None = None,
                    state_name: str = STATE) -> None:
    """Replace the checkpoint at `path` whole: `state` as JSON in `state_name`, `trainer` with
    torch.save, `weights` (if any) as safetensors."""
    with atomic_dir(Path(path)) as tmp:
        torch.save(trainer, tmp / TRAINER)
        if weights is not None:
            save_file(weights, str(tmp / WEIGHTS))
        (tmp / state_name).write_text(json.dumps(state))


def find_checkpoint(path: Path, state_name: str = STATE) -> Path | None:
    """The whole checkpoint at `path`, else at `path.old` (a kill between atomic_dir's renames), else None."""
    path = Path(path)
    return next((d for d in (path, path.with_name(path.name + ".old")) if (d / state_name).is_file()), None)


def load_checkpoint(ckpt: Path, state_name: str = STATE) -> tuple[dict, dict]:
    """The state and the trainer objects saved by `save_checkpoint` in `ckpt` (see `find_checkpoint`)."""
    return json.loads((ckpt / state_name).read_text()), torch.load(ckpt / TRAINER, weights_only=False)


def save_training(path: Path, model, optimizer, scheduler, step: int, state: dict) -> None:
    """A model trainer's checkpoint: weights, optimizer, scheduler, RNG states, and `state` with the step."""
    weights = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}  # tied tensors must not share memory
    trainer = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
               "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}}
    save_checkpoint(path, {"step": step, **state}, trainer, weights)


def load_training(ckpt: Path, model, optimizer, scheduler) -> dict:
    """Restore everything `save_training` saved in `ckpt`; returns its state (with "step")."""
    state, trainer = load_checkpoint(ckpt)
    model.load_state_dict(load_file(str(ckpt / WEIGHTS)))
    optimizer.load_state_dict(trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    torch.set_rng_state(trainer["rng"]["torch"])
    np.random.set_state(trainer["rng"]["numpy"])
    random.setstate(trainer["rng"]["python"])
    return state
