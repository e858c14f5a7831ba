"""A receiver's verified copy of the weights, kept current by walking the delta chain.

`Replica.advance(store)` takes the copy from its version u to the store's latest v one delta
at a time. Each delta becomes a `Patch` (changed positions and bit patterns per tensor) that
is verified *before* anything is written: every patched tensor is rebuilt in a scratch copy
and checked against the trainer's crc32. Then the patch is applied, by default straight into
the replica's arrays, or through the `apply` callback an engine passes to swap it into live
weights between decode steps (see `apply`).

Repairs never fetch a whole model: tensors that a delta fails to deliver (corrupt or
truncated payload, a missing delta file) are fetched one by one (`Store.tensor`, or the trainer's
origin), and a replica older than the store's GC point, or one that joins with weights of its
own (`version=-1`: an engine that loaded the policy from disk), fetches only the tensors whose
checksum differs.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from strop.sync import codec, pieces
from strop.sync.store import MissingPiece, Store
from strop.sync.tensors import StateDict, Tensor

COPY_WHOLE_ABOVE = 1 / 16  # a tensor with more than this share of its elements changed is copied whole, not scattered


@dataclass
class Patch:
    """What one version changes: new bit patterns at flat positions, or whole tensors."""

    version: int
    changes: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    replace: dict[str, Tensor] = field(default_factory=dict)
    drop: list[str] = field(default_factory=list)
    crcs: dict[str, int] = field(default_factory=dict)  # every tensor of the new version

    @property
    def num_changed(self) -> int:
        return sum(len(p) for p, _ in self.changes.values()) + sum(len(t.data) for t in self.replace.values())

    def apply(self, state: StateDict) -> None:
        """Write the patch into `state` in place (arrays must be writable)."""
        for name, (pos, vals) in self.changes.items():
            state[name].data[pos] = vals
        state.update(self.replace)
        for name in self.drop:
            del state[name]


def prepare_patch(state: StateDict, crcs: dict[str, int], blob: bytes | memoryview) -> tuple[Patch, list[str]]:
    """Decode and verify a delta against `state` without modifying it. Returns the patch of
    every tensor that verified, and the names of those that did not (to repair)."""
    h = codec.read_header(blob, with_payloads=False)
    patch = Patch(h.version, crcs={e.name: e.crc32 for e in h.entries})
    have = len(blob) - codec.header_end(blob)
    failed = []
    for unit in h.units():
        if unit[0].part is not None:
            failed += _prepare_group(state, crcs, blob, unit, have, patch)
            continue
        e = unit[0]
        base = state.get(e.name)
        if e.method != "full" and crcs.get(e.name) != e.base_crc32:
            failed.append(e.name)  # our copy is not this delta's base: fetch the tensor
            continue
        if e.length and e.offset + e.length > have:
            failed.append(e.name)
            continue
        try:
            ch = codec.decode_changes(e, base, codec.payload_of(blob, e), check_base=False)
        except codec.DeltaError:
            failed.append(e.name)
            continue
        if ch is None:
            continue
        if isinstance(ch, Tensor):
            ok = ch.crc32() == e.crc32
            patch.replace[e.name] = ch
        else:
            scratch = base.data.copy()
            scratch[ch[0]] = ch[1]
            ok = codec.crc32(scratch) == e.crc32
            if len(ch[0]) > COPY_WHOLE_ABOVE * len(scratch):  # the whole verified copy: written faster than scattered
                patch.replace[e.name] = Tensor(e.dtype, e.shape, scratch)
            else:
                patch.changes[e.name] = ch
        if not ok:
            patch.changes.pop(e.name, None)
            patch.replace.pop(e.name, None)
            failed.append(e.name)
    patch.drop = [k for k in state if k not in patch.crcs]
    return patch, failed


def _prepare_group(
    state: StateDict,
    crcs: dict[str, int],
    blob: bytes | memoryview,
    members: list[codec.Entry],
    have: int,
    patch: Patch,
) -> list[str]:
    """Decode and verify a group of small tensors into `patch`; returns the names that failed."""
    names = [e.name for e in members]
    if any(crcs.get(e.name) != e.base_crc32 for e in members) or members[0].offset + members[0].length > have:
        return names
    try:
        good, bad = codec.decode_group(members, state, codec.payload_of(blob, members[0]), check_base=False)
    except codec.DeltaError:
        return names
    for name, t in good.items():
        at = np.flatnonzero(state[name].data != t.data)  # small tensors: a compare is cheap
        patch.changes[name] = (at, t.data[at])
    return bad


def prepare_pieces(
    state: StateDict, crcs: dict[str, int], blob: bytes | memoryview, want: dict[str, int]
) -> tuple[Patch, list[str]]:
    """`prepare_patch` for a version in pieces (`strop.sync.pieces`: its piece files back to back),
    `want` its manifest's crcs: each tensor's changes are gathered from its pieces, and the whole
    tensor is verified against `want`. Failed: every tensor of `want` not delivered whole and right
    (a piece missing, truncated or corrupt, or our copy not its base)."""
    patch = Patch(codec.read_header(pieces.split(blob)[0], with_payloads=False).version, crcs=dict(want))
    found: dict[str, list[tuple[int, int]]] = {}  # name -> the element ranges its pieces delivered
    changes: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    bad: set[str] = set()
    for f in pieces.split(blob):
        h = codec.read_header(f, with_payloads=False)
        have = len(f) - codec.header_end(f)
        base = pieces.cut(state, [e.name for e in h.entries])
        for unit in h.units():
            spans = [pieces.parse(e.name) for e in unit]
            names = [name for name, _, _ in spans]
            if any(e.name not in base for e in unit) or unit[0].offset + unit[0].length > have:
                bad.update(names)
                continue
            try:
                if unit[0].part is None:
                    ch = codec.decode_changes(
                        unit[0], base[unit[0].name], codec.payload_of(f, unit[0]), check_base=False
                    )
                    new = {unit[0].name: ch} if isinstance(ch, Tensor) else {}
                    if isinstance(ch, tuple):
                        changes.setdefault(names[0], []).append((ch[0] + spans[0][1], ch[1]))
                else:
                    new, failed = codec.decode_group(unit, base, codec.payload_of(f, unit[0]), check_base=False)
                    bad.update(pieces.parse(k)[0] for k in failed)
            except codec.DeltaError:
                bad.update(names)
                continue
            for key, t in new.items():  # whole new pieces: their changes, found by a compare
                name, start, _ = pieces.parse(key)
                at = np.flatnonzero(base[key].data != t.data)
                changes.setdefault(name, []).append((at + start, t.data[at]))
            for name, start, stop in spans:
                found.setdefault(name, []).append((start, len(state[name].data) if stop is None else stop))
    failed = []
    for name, crc in want.items():
        spans = sorted(found.get(name, []))
        whole = bool(spans) and spans[0][0] == 0 and spans[-1][1] == len(state[name].data)
        if name in bad or not whole or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
            failed.append(name)
            continue
        ch = changes.get(name)
        if not ch:  # nothing changed: right if our copy is what this version holds
            if crcs.get(name) != crc:
                failed.append(name)
            continue
        pos, vals = np.concatenate([p for p, _ in ch]), np.concatenate([v for _, v in ch])
        scratch = state[name].data.copy()
        scratch[pos] = vals
        if codec.crc32(scratch) == crc:
            patch.changes[name] = (pos, vals)
        else:
            failed.append(name)
    patch.drop = [k for k in state if k not in want]
    return patch, failed


@dataclass
class SyncReport:
    version: int
    deltas: int = 0  # delta files applied
    delta_bytes: int = 0
    repaired: list[str] = field(default_factory=list)  # "v{version}:{tensor}" fetched one by one
    repaired_bytes: int = 0
    seconds: float = 0.0


class Replica:
    def __init__(self, state: StateDict, version: int, crcs: dict[str, int] | None = None):
        self.state = state
        self.version = version
        self.crcs = crcs if crcs is not None else {k: t.crc32() for k, t in state.items()}

    @classmethod
    def bootstrap(cls, store: Store) -> "Replica":
        """A new receiver: the store's snapshot (the one full download of its life) + chain."""
        snap = store.head()["snapshot"]
        state = {k: Tensor(t.dtype, t.shape, t.data.copy()) for k, t in store.snapshot(snap).items()}
        r = cls(state, snap, store.manifest(snap).crcs())
        r.advance(store)
        return r

    def advance(
        self,
        store: Store,
        target: int | None = None,
        fetch: Callable[[int], bytes] | None = None,
        apply: Callable[[Patch], None] | None = None,
        tensor: Callable[[str, int], Tensor] | None = None,
    ) -> SyncReport:
        """Reach version `target` (default: latest). `fetch(v)` gets delta v (default: from the
        store; a relay passes its own); `apply(patch)` writes a verified patch (default: into
        `self.state` at once); `tensor(name, v)` fetches one tensor for a repair (default: rebuilt
        from the store; an engine asks the trainer's origin, which also holds the latest version
        itself). A version that cannot be rebuilt at all (the store's own copy of its delta is
        damaged, and the trainer has moved on) is skipped: the replica jumps to the latest version,
        fetching the tensors that differ. Raises MissingPiece when even that fails."""
        t0 = time.perf_counter()
        head = store.head()
        target = head["latest"] if target is None else target
        fetch = fetch or store.delta_bytes
        apply = apply or (lambda p: p.apply(self.state))
        tensor = tensor or store.tensor
        rep = SyncReport(self.version)
        if self.version < head["snapshot"]:  # our next deltas were garbage-collected
            self._step(self._jump(store, head["snapshot"], tensor, rep), apply)
        while self.version < target:
            v = self.version + 1
            try:
                patch = self._next(store, v, fetch, tensor, rep)
            except MissingPiece:
                latest = store.head()["latest"]
                if latest <= v:
                    raise
                patch = self._jump(store, latest, tensor, rep)
                target = max(target, latest)
            self._step(patch, apply)
        rep.version = self.version
        rep.seconds = time.perf_counter() - t0
        return rep

    def _step(self, patch: Patch, apply: Callable[[Patch], None]) -> None:
        apply(patch)
        self.crcs, self.version = patch.crcs, patch.version

    def _next(
        self, store: Store, v: int, fetch: Callable[[int], bytes], tensor: Callable[[str, int], Tensor], rep: SyncReport
    ) -> Patch:
        """The verified patch to version v: delta v, with what it fails to deliver repaired."""
        try:
            blob = fetch(v)
            if pieces.is_pieced(blob):
                patch, failed = prepare_pieces(self.state, self.crcs, blob, store.manifest(v).crcs())
            else:
                patch, failed = prepare_patch(self.state, self.crcs, blob)
            rep.deltas += 1
            rep.delta_bytes += len(blob)
        except (MissingPiece, codec.DeltaError):  # missing link, or a header beyond use
            patch, failed = self._patch_from_manifest(store, v)
        _repair(tensor, patch, failed, rep)
        return patch

    def _patch_from_manifest(self, store: Store, v: int) -> tuple[Patch, list[str]]:
        """Without delta v: its manifest says which tensors changed; all of them need fetching."""
        m = store.manifest(v)
        crcs = m.crcs()
        failed = [k for k, c in crcs.items() if self.crcs.get(k) != c]
        return Patch(v, crcs=crcs, drop=[k for k in self.state if k not in crcs]), failed

    def _jump(self, store: Store, v: int, tensor: Callable[[str, int], Tensor], rep: SyncReport) -> Patch:
        """Straight to version v: only the tensors whose checksum differs from ours, fetched whole."""
        patch, failed = self._patch_from_manifest(store, v)
        _repair(tensor, patch, failed, rep)
        return patch


def _repair(tensor: Callable[[str, int], Tensor], patch: Patch, names: list[str], rep: SyncReport) -> None:
    """Fetch each named tensor at the patch's version, whole, into the patch."""
    for name in names:
        t = tensor(name, patch.version)
        patch.replace[name] = Tensor(t.dtype, t.shape, t.data.copy())  # writable for later patches
        rep.repaired.append(f"v{patch.version}:{name}")
        rep.repaired_bytes += t.nbytes
