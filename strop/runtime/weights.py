"""An engine kept current by the weight transport (`strop.sync`): the same wiring in every runtime.

The engine first rounds its own weights (loaded from the policy directory) to bf16 values, as the
trainer publishes them. A sync thread then follows its cluster's relay (over HTTP, or by direct
calls when the relay runs in the engine's process): each version's delta is verified by the
engine's replica against the trainer's checksums, staged, and swapped into the live weights
between two decode steps (`Engine.update_weights`). The engine's packed copies of the tensors
that changed (and only those) are rebuilt from their new values on the sync thread beforehand
(`Forward.prepare`), so the pause is the in-place write and a pointer swap. A new engine — at
start, or joining mid-run — downloads no snapshot when its own weights already match: it fetches
only the tensors whose checksums differ from the store's snapshot, then walks the chain to the
latest version.
"""

import threading

import torch

from strop.config import Config
from strop.engine.engine import Engine
from strop.engine.policy_client import EnginePolicy
from strop.policy_api import PolicyClient
from strop.sync.apply import EngineSync, Staged, apply_inplace
from strop.sync.relay import RelayLink
from strop.sync.store import Store


class SyncedEngine:
    def __init__(self, engine: Engine, store_url: str, relay: RelayLink, origin_url: str):
        self.engine = engine
        store = Store(store_url)
        names = sorted(store.manifest(store.head()["snapshot"]).tensors)
        named = engine.named_tensors()
        missing = [n for n in names if n not in named]
        if missing:
            raise ValueError(f"the engine's model has no tensors {missing[:3]}: it is not the trainer's policy")
        # the same weights, rounded as the trainer publishes them: not a new version (versions never go back,
        # and the trainer's first one may be the engine's own)
        engine.update_weights(
            apply_fn=lambda named: _round_to_bf16([named[n] for n in names]), version=engine.version
        ).wait()
        self.sync = EngineSync({n: named[n] for n in names}, version=-1, swap=self._swap, with_values=True)
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self.sync.follow, args=(store, relay, origin_url, self.stop), name="strop-weight-sync", daemon=True
        )
        self.thread.start()

    def _swap(self, staged: Staged) -> float:
        """Repack the touched tensors from their new values here, on the sync thread, while the engine
        decodes; then, between two decode steps, write the patch and install the repacking. Returns
        the engine's pause."""
        derived = self.engine.forward.prepare(staged.names, staged.values)
        return self.engine.update_weights(
            apply_fn=lambda named: apply_inplace(self.sync.live, staged),
            version=staged.version,
            changed=staged.names,
            derived=derived,
        ).wait()

    def wait_version(self, version: int, timeout: float | None = None) -> bool:
        return self.sync.wait_version(version, timeout)

    def policy(self) -> PolicyClient:
        return EnginePolicy(self.engine)

    def stats(self) -> dict:
        return {**self.engine.stats(), "busy_s": self.engine.busy_s}  # a TimedEngine's

    def close(self) -> None:
        """Stop following the relay (the thread ends at its next poll), then the engine's loop."""
        self.stop.set()
        self.engine.stop()


def sync_seconds(published_at: dict[int, float], swapped_at: list[dict[int, float]]) -> dict[int, float]:
    """Per published version after the first that every engine served: seconds from the trainer
    announcing it (`TrainerSync.published_at`) to the last engine serving it (each engine's
    `EngineSync.swapped_at`): the whole weight sync, encode to swap. Clocks are `time.time()`."""
    return {
        v: max(s[v] for s in swapped_at) - t
        for v, t in sorted(published_at.items())
        if v > 0 and swapped_at and all(v in s for s in swapped_at)
    }


def relay_keep(cfg: Config) -> int:
    """Deltas a relay keeps: the store's whole chain, so an engine that joins walks it from the relay
    without the trainer sending any delta twice."""
    return 2 * cfg.sync.keep_deltas + 1 if cfg.sync.keep_deltas else 16


@torch.no_grad()
def _round_to_bf16(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        if t.dtype != torch.bfloat16:
            t.copy_(t.to(torch.bfloat16))
