"""Resumable training checkpoints: model, optimizer, scheduler, step and RNG states, written
atomically (`strop.outputs.atomic_dir`) so a kill at any moment leaves the previous checkpoint
intact."""

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from strop.outputs import atomic_dir


def save_checkpoint(path: Path, model, optimizer, scheduler, step: int, state: dict) -> None:
    with atomic_dir(path) as tmp:
        weights = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
        save_file(weights, str(tmp / "model.safetensors"))  # clones: tied tensors must not share memory
        torch.save(
            {
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
            },
            tmp / "trainer.pt",
        )
        (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2))


def load_checkpoint(path: Path, model, optimizer, scheduler) -> dict:
    """Restore everything saved by `save_checkpoint`; returns its state dict (with "step")."""
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    extra = torch.load(path / "trainer.pt", weights_only=False)
    optimizer.load_state_dict(extra["optimizer"])
    scheduler.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["rng"]["torch"])
    np.random.set_state(extra["rng"]["numpy"])
    random.setstate(extra["rng"]["python"])
    return json.loads((path / "state.json").read_text())
