"""Swap new weights into a running engine in place, between two decode steps.

How an engine is kept current (the engine owns its loop; sync never calls into it):

    sync = EngineSync(live, swap=...)   # live: the engine's tensors by the trainer's names
    # a background thread follows the cluster's relay, walking the chain with a `Replica`:
    sync.follow(store, relay_link, origin_url, stop)
    # `swap(staged)` runs `apply_inplace(live, staged)` between two decode steps and returns the pause

All the work that takes time — fetching, decoding, verifying every tensor against the
trainer's checksum, moving indices and values to the device — happens on the sync thread
while the engine keeps decoding. The swap only writes the changed elements into the live
tensors (`index_put_` on each touched tensor, a numpy scatter on CPU), so the pause is
proportional to the number of changed weights, not to the model size; `Staged.names` tells the
engine which tensors changed (the only ones whose derived copies it repacks).

Live tensors may be wider than the wire: an fp32 engine holding bf16 values (as strop's CPU
engine does) gets each bf16 bit pattern widened exactly (the high half of the fp32 word). The
replica's verified copy is a host mirror at the wire's precision, patched on the sync thread
after each swap, so it never costs engine time.

For a one-off swap without the thread: `stage(patch, live)` then `apply_inplace(live, staged)`.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from strop.sync.relay import RelayLink, tensor_fetcher
from strop.sync.replica import COPY_WHOLE_ABOVE, Patch, Replica, SyncReport
from strop.sync.store import MissingPiece, Store
from strop.sync.tensors import Tensor

_DTYPES = {
    torch.bfloat16: ("BF16", torch.int16),
    torch.float16: ("F16", torch.int16),
    torch.float32: ("F32", torch.int32),
}
_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def bits_view(t: torch.Tensor) -> Tensor:
    """The codec's view of a contiguous tensor: a numpy array of its bit patterns. For a CPU
    tensor it shares memory (writes show up in the tensor); otherwise it is a host copy."""
    name, as_int = _DTYPES[t.dtype]
    flat = t.detach().reshape(-1).view(as_int)
    arr = flat.numpy() if flat.device.type == "cpu" else flat.cpu().numpy()
    return Tensor(name, tuple(t.shape), arr.view(f"<u{arr.itemsize}"))


def _live_bits(wire: str, live: torch.Tensor, name: str) -> Callable[[np.ndarray], np.ndarray]:
    """How wire bit patterns become the live tensor's: as they are, or bf16 widened to fp32."""
    have = _DTYPES.get(live.dtype, ("?",))[0]
    if have == wire:
        return lambda bits: bits
    if (wire, have) == ("BF16", "F32"):
        return lambda bits: bits.astype(np.uint32) << 16
    raise ValueError(f"tensor {name!r}: {wire} updates cannot be written into a {live.dtype} engine tensor")


@dataclass
class Staged:
    """A verified patch with its indices and values already on the live tensors' devices.
    CPU tensors are patched through numpy views: a single-threaded scatter, because torch's
    intra-op thread pool costs more to wake (tens of ms on a busy machine) than the write; where
    the whole new tensor is staged anyway and more than `COPY_WHOLE_ABOVE` of it changed, a contiguous copy
    of it (an order of magnitude cheaper per element than a scatter)."""

    version: int
    names: list[str] = field(default_factory=list)  # every tensor the patch touches
    puts: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    cpu_puts: dict[str, tuple[np.ndarray, np.ndarray | slice, np.ndarray]] = field(
        default_factory=dict
    )  # view, idx, vals
    copies: dict[str, torch.Tensor] = field(default_factory=dict)
    values: dict[str, torch.Tensor] = field(default_factory=dict)  # whole new tensors, when staged with a base


def stage(
    patch: Patch,
    live: dict[str, torch.Tensor],
    wire: dict[str, str] | None = None,
    base: dict[str, Tensor] | None = None,
) -> Staged:
    """Prepare `patch` for `apply_inplace` (slow part: conversions and host-to-device copies).
    `wire`: each tensor's dtype on the wire (default: the live tensor's own). `base`: the
    replica's copy the patch applies to; given, each touched tensor's whole new value is staged
    too, at the live dtype (`values`: an engine derives its packed copies from them before the swap)."""
    out = Staged(patch.version, sorted({*patch.changes, *patch.replace}))
    if patch.drop:
        raise ValueError(f"patch drops tensors {patch.drop}: the engine must reload its model")
    wire = {**(wire or {}), **{name: t.dtype for name, t in patch.replace.items()}}
    for name, (pos, vals) in patch.changes.items():
        t = live[name]
        widen = _live_bits(wire.get(name) or _DTYPES[t.dtype][0], t, name)
        whole = None
        if base is not None:
            bits = base[name].data.copy()
            bits[pos] = vals
            whole = widen(bits)
            out.values[name] = _as_torch(whole, t)
        vals = widen(vals)
        if t.device.type == "cpu":
            dense = whole is not None and len(pos) > COPY_WHOLE_ABOVE * len(whole)
            out.cpu_puts[name] = (bits_view(t).data, slice(None), whole) if dense else (bits_view(t).data, pos, vals)
            continue
        as_int = _DTYPES[t.dtype][1]
        idx = torch.from_numpy(pos).to(t.device, non_blocking=True)
        v = torch.from_numpy(vals.view(np.int16 if vals.itemsize == 2 else np.int32)).to(t.device, non_blocking=True)
        out.puts[name] = (idx, v.view(as_int))
    for name, new in patch.replace.items():
        t = live.get(name)
        if t is None or tuple(t.shape) != new.shape:
            raise ValueError(f"tensor {name!r} changed shape: the engine must reload its model")
        _live_bits(wire[name], t, name)  # refuses what cannot be widened exactly
        as_int = np.int16 if new.data.itemsize == 2 else np.int32
        src = torch.from_numpy(new.data.view(as_int).copy()).view(_TORCH[new.dtype]).view(t.shape)
        out.copies[name] = src.to(t.device, t.dtype, non_blocking=True)
        if base is not None:
            out.values[name] = out.copies[name]
    return out


def _as_torch(bits: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """Flat bit patterns of `like`'s dtype as a tensor shaped and placed like it."""
    as_int = _DTYPES[like.dtype][1]
    flat = torch.from_numpy(bits.view(np.int16 if bits.itemsize == 2 else np.int32)).view(as_int)
    return flat.view(like.dtype).view(like.shape).to(like.device)


@torch.no_grad()
def apply_inplace(live: dict[str, torch.Tensor], staged: Staged) -> float:
    """Write a staged patch into the live tensors; returns the pause in seconds."""
    t0 = time.perf_counter()
    for view, idx, vals in staged.cpu_puts.values():
        view[idx] = vals
    for name, (idx, vals) in staged.puts.items():
        t = live[name]
        t.view(-1).view(vals.dtype).index_put_((idx,), vals)
    for name, src in staged.copies.items():
        live[name].copy_(src)
    if any(t.device.type == "cuda" for t in live.values()):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


class EngineSync:
    """Keeps an engine's live weights equal to the trainer's latest version (bf16, as published).

    `live`: the engine's tensors under the trainer's names, holding bf16 values (as bf16 or fp32).
    `version`: the version they hold, or -1 for weights of the engine's own (loaded from disk), in
    which case the first sync fetches only the tensors whose checksum differs from the store's.
    `swap(staged) -> pause seconds` writes a staged patch between two decode steps (default: at once);
    `with_values`: stage each touched tensor's whole new value too, for an engine that repacks."""

    def __init__(
        self,
        live: dict[str, torch.Tensor],
        version: int = -1,
        swap: Callable[[Staged], float] | None = None,
        with_values: bool = False,
    ):
        mirror = {}
        for k, t in live.items():
            wire = t.detach().to(torch.bfloat16).cpu()
            if not torch.equal(wire.to(t.dtype), t.detach().cpu()):
                raise ValueError(f"live tensor {k!r} holds values that are not bf16: round the engine's weights first")
            mirror[k] = bits_view(wire.clone())
        self.live = live
        self.replica = Replica(mirror, version)  # the verified host mirror, at the wire's precision
        self.wire = {k: t.dtype for k, t in self.replica.state.items()}
        self.with_values = with_values  # stage whole new tensors too (see `stage`)
        self.swap = swap or (lambda staged: apply_inplace(self.live, staged))
        self.cond = threading.Condition()
        self.pauses: list[float] = []
        self.reports: list[SyncReport] = []  # one per `advance`
        self.swapped_at: dict[int, float] = {}  # version -> time.time() it went live
        self.error: BaseException | None = None  # what stopped `follow`, re-raised by `wait_version`
        self.version = version  # what the live weights hold

    def _apply(self, patch: Patch) -> None:
        """The replica's apply callback: stage, swap in between decode steps, then bring the mirror up."""
        pause = self.swap(stage(patch, self.live, self.wire, self.replica.state if self.with_values else None))
        patch.apply(self.replica.state)
        with self.cond:
            self.pauses.append(pause)
            self.swapped_at[patch.version] = time.time()
            self.version = patch.version
            self.cond.notify_all()

    def advance(
        self,
        store: Store,
        target: int | None = None,
        fetch: Callable[[int], bytes] | None = None,
        tensor: Callable[[str, int], Tensor] | None = None,
    ) -> SyncReport:
        """Walk the chain to `target` (default: the store's latest), swapping in every version."""
        rep = self.replica.advance(store, target, fetch=fetch, apply=self._apply, tensor=tensor)
        with self.cond:
            self.reports.append(rep)
            self.cond.notify_all()
        return rep

    def follow(self, store: Store, relay: RelayLink, origin_url: str, stop: threading.Event) -> None:
        """Sync-thread loop: long-poll the relay and advance to each version it announces, until
        `stop`. Deltas come from the relay; single tensors (a join, a repair) from the store, or
        from the trainer's origin when the store cannot rebuild them."""
        from_origin = tensor_fetcher(origin_url)

        def tensor(name: str, v: int) -> Tensor:
            try:
                return store.tensor(name, v)
            except MissingPiece:
                return from_origin(name, v)

        try:
            while not stop.is_set():
                try:
                    head = relay.head(self.version)
                    if head > self.version:
                        self.advance(store, head, fetch=relay.delta, tensor=tensor)
                except (OSError, MissingPiece):  # relay restarting, or the store mid-GC: ask again
                    stop.wait(0.2)
        except BaseException as e:  # a swap the engine refused: waiters must not wait forever
            with self.cond:
                self.error = e
                self.cond.notify_all()
            raise

    def wait_version(self, version: int, timeout: float | None = None) -> bool:
        """Block until the live weights are at `version` or later; False on timeout."""
        with self.cond:
            self.cond.wait_for(lambda: self.version >= version or self.error is not None, timeout)
            if self.error is not None:
                raise RuntimeError(f"weight sync stopped: {self.error}") from self.error
            return self.version >= version
