"""Swap new weights into a running engine in place, between two decode steps.

How an engine uses it (the engine owns its loop; sync never calls into it):

    sync = EngineSync(dict(model.state_dict()), version=v0)   # live bf16 tensors, any device
    # a background thread (or the relay client) keeps the copy current:
    threading.Thread(target=sync.follow, args=(store, fetch), daemon=True).start()
    # in the decode loop, after each step:
    pause_s = sync.swap_point()        # 0.0 when nothing is pending
    # the next token is computed with version sync.version

All the work that takes time — fetching, decoding, verifying every tensor against the
trainer's checksum, moving indices and values to the device — happens on the sync thread
while the engine keeps decoding. `swap_point` only writes the changed elements into the live
tensors (`index_put_` on each touched tensor, a numpy scatter on CPU), so the pause is proportional to the number of
changed weights, not to the model size. A CPU engine's live tensors are themselves the
replica's state (numpy views share their memory); a GPU engine gets a host mirror.

For a one-off swap without the thread: `stage(patch, live)` then `apply_inplace(live, staged)`.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from strop.sync.replica import Patch, Replica
from strop.sync.store import Store
from strop.sync.tensors import Tensor

_DTYPES = {torch.bfloat16: ("BF16", torch.int16), torch.float16: ("F16", torch.int16),
           torch.float32: ("F32", torch.int32)}


def bits_view(t: torch.Tensor) -> Tensor:
    """The codec's view of a contiguous tensor: a numpy array of its bit patterns. For a CPU
    tensor it shares memory (writes show up in the tensor); otherwise it is a host copy."""
    name, as_int = _DTYPES[t.dtype]
    flat = t.detach().reshape(-1).view(as_int)
    arr = flat.numpy() if flat.device.type == "cpu" else flat.cpu().numpy()
    return Tensor(name, tuple(t.shape), arr.view(f"<u{arr.itemsize}"))


@dataclass
class Staged:
    """A verified patch with its indices and values already on the live tensors' devices.
    CPU tensors are patched through numpy views: a single-threaded scatter, because torch's
    intra-op thread pool costs more to wake (tens of ms on a busy machine) than the write."""

    version: int
    puts: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    cpu_puts: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)  # view, idx, vals
    copies: dict[str, torch.Tensor] = field(default_factory=dict)


def stage(patch: Patch, live: dict[str, torch.Tensor]) -> Staged:
    """Prepare `patch` for `apply_inplace` (slow part: conversions and host-to-device copies)."""
    out = Staged(patch.version)
    if patch.drop:
        raise ValueError(f"patch drops tensors {patch.drop}: the engine must reload its model")
    for name, (pos, vals) in patch.changes.items():
        t = live[name]
        if t.device.type == "cpu":
            out.cpu_puts[name] = (bits_view(t).data, pos, vals)
            continue
        as_int = _DTYPES[t.dtype][1]
        idx = torch.from_numpy(pos).to(t.device, non_blocking=True)
        v = torch.from_numpy(vals.view(np.int16 if vals.itemsize == 2 else np.int32)).to(t.device, non_blocking=True)
        out.puts[name] = (idx, v.view(as_int))
    for name, new in patch.replace.items():
        t = live.get(name)
        if t is None or tuple(t.shape) != new.shape or _DTYPES.get(t.dtype, ("",))[0] != new.dtype:
            raise ValueError(f"tensor {name!r} changed shape or dtype: the engine must reload its model")
        as_int = _DTYPES[t.dtype][1]
        src = torch.from_numpy(new.data.view(np.int16 if new.data.itemsize == 2 else np.int32).copy())
        out.copies[name] = src.to(t.device, non_blocking=True).view(as_int).view(t.shape).view(t.dtype)
    return out


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
    """Keeps an engine's live weights current; the engine calls `swap_point()` between steps."""

    def __init__(self, live: dict[str, torch.Tensor], version: int):
        self.live = live
        self.version = version
        on_cpu = all(t.device.type == "cpu" for t in live.values())
        # CPU: the replica's state *is* the live memory, so apply_inplace updates both at once
        self.replica = Replica({k: bits_view(t) for k, t in live.items()}, version)
        self.mirror = not on_cpu
        self.pending: list[tuple[Staged, Patch, threading.Event]] = []
        self.lock = threading.Lock()
        self.pauses: list[float] = []

    def _hand_over(self, patch: Patch) -> None:
        """The replica's apply callback: stage, then wait until the engine has swapped it in
        (the next delta is decoded against the swapped-in weights)."""
        done = threading.Event()
        with self.lock:
            self.pending.append((stage(patch, self.live), patch, done))
        done.wait()

    def follow(self, store: Store, fetch: Callable[[int], bytes] | None = None, poll_s: float = 0.05,
               stop: threading.Event | None = None) -> None:
        """Sync-thread loop: advance to each new version the store announces."""
        stop = stop or threading.Event()
        while not stop.is_set():
            if store.head()["latest"] > self.replica.version:
                self.replica.advance(store, fetch=fetch, apply=self._hand_over)
            stop.wait(poll_s)

    def swap_point(self) -> float:
        """Call between decode steps: applies every verified pending version; returns the pause."""
        with self.lock:
            pending, self.pending = self.pending, []
        pause = 0.0
        for staged, patch, done in pending:
            pause += apply_inplace(self.live, staged)
            if self.mirror:
                patch.apply(self.replica.state)
            self.version = staged.version
            done.set()
        if pending:
            self.pauses.append(pause)
        return pause
