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
The trainer's files are written by `strop.train.sharded_checkpoint` (each rank its shards);
this module is the layout and its atomicity.
"""

import json
from pathlib import Path
from typing import Callable

from strop.outputs import atomic_dir

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
