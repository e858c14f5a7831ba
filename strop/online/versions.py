"""The run's own weight versions, as a server may load them: the versioned store the trainer
publishes to (`strop.sync.store`). A client names a version, never a path, so nobody who can
reach the port can make the server read a file of their choosing."""

import numpy as np
import torch

from strop.sync.apply import _TORCH
from strop.sync.codec import DeltaError
from strop.sync.store import MissingPiece, Store
from strop.sync.tensors import Tensor


class UnknownVersion(LookupError):
    pass


def to_torch(t: Tensor) -> torch.Tensor:
    """A store tensor (raw bits) as a torch tensor of its own dtype, bit for bit."""
    if t.dtype not in _TORCH:
        raise ValueError(f"weights of dtype {t.dtype} cannot be served")
    signed = np.int16 if t.data.itemsize == 2 else np.int32
    return torch.from_numpy(t.data.view(signed).copy()).view(_TORCH[t.dtype]).reshape(t.shape)


class Versions:
    def __init__(self, url: str):
        self.store = Store(url)

    def available(self) -> range:
        """Versions the store can rebuild: its snapshot through its latest delta."""
        head = self.store.head()
        return range(head["snapshot"], head["latest"] + 1)

    def tensors(self, version: int) -> dict[str, torch.Tensor]:
        """Every tensor of `version`, or UnknownVersion."""
        try:
            have = self.available()
        except MissingPiece:
            raise UnknownVersion("this run's weight store holds no versions yet") from None
        if version not in have:
            raise UnknownVersion(
                f"version {version} is not in this run's weight store (it holds {have.start}..{have.stop - 1})"
            )
        try:
            return {name: to_torch(t) for name, t in self.store.state(version).items()}
        except (MissingPiece, DeltaError) as e:
            raise UnknownVersion(f"version {version} cannot be rebuilt from the store: {e}") from None
