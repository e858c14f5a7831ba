"""The trainer side of weight sync for in-process runtimes: each published bf16 snapshot goes out
as a lossless delta against the previous one, and what the engines load is what a receiver
reconstructs from that delta (checksum-verified by `codec.decode`), so the RL run exercises the
same bytes a cluster would ship and its `bytes_synced` counts the delta, not the snapshot.
"""

from pathlib import Path

import numpy as np
import torch

from strop.sync import codec, tensors
from strop.sync.apply import bits_view
from strop.sync.tensors import StateDict

_TORCH = {2: (np.int16, torch.bfloat16), 4: (np.int32, torch.float32)}


def _to_torch(state: StateDict, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        as_int, _ = _TORCH[t.data.itemsize]
        out[name] = torch.from_numpy(t.data.view(as_int).copy()).view(like[name].dtype).view(t.shape)
    return out


class DeltaPublisher:
    """`publish(version, state)` -> (tensors the engines load, bytes on the wire). The first
    snapshot (and any after `reset`) goes out whole."""

    def __init__(self):
        self.base: StateDict | None = None
        self.base_version = -1
        self.previous: StateDict | None = None  # the version before `base`, for `save_last`

    def reset(self) -> None:
        self.base, self.base_version, self.previous = None, -1, None

    def save_last(self, out_dir: Path) -> list[Path]:
        """Write the last two published versions as `<version>.safetensors` (bf16): the real
        consecutive snapshots `strop bench sync --demo-run` measures the codec on."""
        out_dir.mkdir(parents=True, exist_ok=True)
        pairs = [(self.base_version - 1, self.previous), (self.base_version, self.base)]
        paths = []
        for version, state in pairs:
            if state is not None:
                paths.append(out_dir / f"{version:08d}.safetensors")
                tensors.save(state, str(paths[-1]))
        return paths

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        new = {k: bits_view(v.detach().contiguous()) for k, v in state.items()}
        if self.base is None:
            self.base, self.base_version = new, version
            return state, sum(t.nbytes for t in new.values())
        blob = codec.encode(self.base, new, version=version, base_version=self.base_version)
        received = codec.decode(self.base, blob)  # verifies every tensor against the trainer's checksum
        self.previous, self.base, self.base_version = self.base, received, version
        return _to_torch(received, state), len(blob)
