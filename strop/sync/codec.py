"""A delta file: one state dict (version v) expressed against the previous one (version u).

Layout: magic `STRPDLT1`, u32 header length, u32 crc of the header, the header (zstd'd
JSON), then the tensor payloads back to back. The header holds the versions, the payload size
and one entry per tensor of the *new* state dict:

    name, method, dtype, shape, offset, length,
    payload_crc32   crc of this tensor's payload bytes (detects corruption in transit),
    base_crc32      crc of the tensor it applies to (detects the wrong base),
    crc32           crc of the reconstructed tensor (verifies every result, end to end).

Methods, chosen per tensor as the smallest payload (`encode_tensor`): `same` (no payload),
`delta` (the changed positions and their steps, see `tensor_codec`: the method of RL-rate
updates, which change a few percent of the elements), `xor` (zstd of the byte planes of old XOR
new: changes of most elements, as one AdamW step at a pretraining learning rate makes), `full`
(zstd of the byte planes: new tensors, changed shape or dtype, non-float dtypes, a base that no
longer predicts the tensor). Base tensors absent from the new state dict are dropped.

Small tensors (norms, biases, a tiny model's projections) would spend more time in per-tensor
overhead than in coding, so deltas of up to SMALL elements are coded in groups: one payload
for the concatenation of several same-dtype tensors, shared by their entries, each of which
holds its element offset in the group (`part`) and its own base and result crcs. A damaged
group payload costs re-fetching its members — at most GROUP elements, never a whole model.
Groups hold deltas only: a small tensor whose change is denser than `tensor_codec.XOR_ABOVE` is
coded alone (as `xor`, or `full`), for the few such tensors a model has.

Every failure raises `DeltaError` naming the affected tensors, so a receiver can repair just
those (see `store`).
"""

import json
import struct
from dataclasses import dataclass

import numpy as np
import zstandard

from strop.sync import tensor_codec as tc
from strop.sync.tensors import StateDict, Tensor, bits_dtype, crc32

MAGIC = b"STRPDLT1"
# the delta file's format: 4: the `xor` method; 3: every crc is CRC-32C (`tensors.crc32`); 2: one low
# exponent class coded by rank, the top class by position; groups. A format-3 file is a format-4 file
# without `xor` entries, so this reader reads it too.
FORMAT = 4
READABLE = (3, 4)
METHODS = ("same", "delta", "xor", "full")
SMALL = 1 << 17  # elements: tensors up to this size are delta-coded in groups
GROUP = 1 << 20  # elements per group at most
_PREFIX = struct.Struct("<8sII")
PREFIX_SIZE = _PREFIX.size


def header_end(prefix: bytes) -> int:
    """Offset where the payloads start, from the file's first PREFIX_SIZE bytes."""
    return _PREFIX.size + _PREFIX.unpack(prefix[: _PREFIX.size])[1]


class DeltaError(ValueError):
    """A delta that cannot be applied: corrupt, truncated, or for another base. `tensors` names
    the affected tensors (all of them when the file itself is unreadable)."""

    def __init__(self, message: str, tensors: list[str] | None = None):
        super().__init__(message)
        self.tensors = tensors


@dataclass
class Entry:
    name: str
    method: str  # one of METHODS
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int
    payload_crc32: int
    base_crc32: int | None  # None for `full`: it needs no base
    crc32: int
    part: int | None = None  # in a group: element offset in the group's concatenated tensors

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class Header:
    version: int
    base_version: int
    payload_bytes: int
    entries: list[Entry]

    def entry(self, name: str) -> Entry:
        return next(e for e in self.entries if e.name == name)

    def units(self) -> list[list[Entry]]:
        """The entries by payload: [entry] for a tensor coded alone, its members for a group."""
        out, groups = [], {}
        for e in self.entries:
            if e.part is None:
                out.append([e])
            elif e.offset in groups:
                groups[e.offset].append(e)
            else:
                out.append(groups.setdefault(e.offset, [e]))
        return out


def _changes(old: Tensor | None, new: Tensor, *, mask: bool = True) -> tuple[str, np.ndarray | None, int]:
    """The method a tensor needs on its own terms ("same", "full" without a usable base, "xor"
    for a change denser than `tc.XOR_ABOVE`, else "delta"), with the change mask (see
    `tensor_codec.count_changes`; None unless `mask`) and count for a delta."""
    if old is None or old.dtype != new.dtype or old.shape != new.shape or new.dtype not in tc.FLOATS:
        return "full", None, 0
    changed, m = tc.count_changes(old.data, new.data, with_mask=mask)
    n = len(new.data)
    if not m:
        return "same", None, 0
    return ("xor", None, m) if m > tc.XOR_ABOVE * n else ("delta", changed, m)


def encode_tensor(old: Tensor | None, new: Tensor) -> tuple[str, bytes]:
    """(method, payload) for one tensor coded alone: the smallest of same / delta / xor / full.
    A candidate is tried only where the one before came out large: `xor` where the delta
    passes 1/8 of the raw size, 2 bits a bf16 element (on `synthetic`'s AdamW steps at lr 1e-5
    to 3e-3 the XOR wins from about 3.5 bits, 55% of the elements changed); `full` where the
    XOR passes half the raw size, a base that barely predicts the tensor."""
    method, changed, m = _changes(old, new)
    if method == "same":
        return method, b""
    if method == "full":
        return method, tc.encode_full(new.data)
    tried = []
    if method == "delta":
        tried.append(("delta", tc.encode_delta(old.data, new.data, new.dtype, changed, m)))
    if method == "xor" or len(tried[0][1]) > new.nbytes // 8:
        tried.append(("xor", tc.encode_xor(old.data, new.data)))
        if len(tried[-1][1]) > new.nbytes // 2:
            tried.append(("full", tc.encode_full(new.data)))
    return min(tried, key=lambda t: len(t[1]))


def _plan(base: StateDict, new: StateDict) -> dict[str, tuple[str, bytes] | list[str]]:
    """name -> (method, payload) for tensors coded alone, or -> the member names of its group."""
    out, small = {}, {}
    for name in sorted(new):
        t, old = new[name], base.get(name)
        method, _, _ = _changes(old, t, mask=False) if len(t.data) <= SMALL else (None, None, 0)
        if method == "delta":
            small.setdefault(t.dtype, []).append(name)
        else:
            out[name] = ("same", b"") if method == "same" else encode_tensor(old, t)
    for names in small.values():
        groups, size = [[]], 0
        for name in names:
            if size + len(new[name].data) > GROUP and groups[-1]:
                groups.append([])
                size = 0
            groups[-1].append(name)
            size += len(new[name].data)
        for g in groups:
            if len(g) == 1:
                out[g[0]] = encode_tensor(base[g[0]], new[g[0]])
            else:
                out.update((name, g) for name in g)
    return out


def encode(
    base: StateDict,
    new: StateDict,
    *,
    version: int,
    base_version: int,
    base_crcs: dict[str, int] | None = None,
    new_crcs: dict[str, int] | None = None,
) -> bytes:
    """The delta file taking `base` (version `base_version`) to `new` (version `version`).

    Pass the crcs when already known (the previous manifest holds the base's), to skip
    hashing those tensors again."""
    base_crcs = base_crcs or {}
    new_crcs = new_crcs or {}
    plan = _plan(base, new)
    entries, payloads, offset, placed = [], [], 0, {}
    for name in sorted(new):
        t, old, how = new[name], base.get(name), plan[name]
        part = None
        if isinstance(how, list):  # a group: its payload goes where its first member's would
            if how[0] not in placed:
                payload = tc.encode_delta(
                    np.concatenate([base[k].data for k in how]), np.concatenate([new[k].data for k in how]), t.dtype
                )
                starts = np.cumsum([0] + [len(new[k].data) for k in how[:-1]]).tolist()
                placed[how[0]] = (offset, len(payload), crc32(payload), dict(zip(how, starts)))
                payloads.append(payload)
                offset += len(payload)
            at, length, pcrc, starts = placed[how[0]]
            method, part = "delta", starts[name]
        else:
            method, payload = how
            at, length, pcrc = offset, len(payload), crc32(payload)
            payloads.append(payload)
            offset += len(payload)
        base_crc = None
        if method != "full":
            base_crc = base_crcs[name] if name in base_crcs else old.crc32()
        crc = new_crcs[name] if name in new_crcs else (base_crc if method == "same" else t.crc32())
        entries.append(Entry(name, method, t.dtype, t.shape, at, length, pcrc, base_crc, crc, part))
    head = {
        "format": FORMAT,
        "version": version,
        "base_version": base_version,
        "payload_bytes": offset,
        "tensors": [
            [
                e.name,
                e.method,
                e.dtype,
                list(e.shape),
                e.offset,
                e.length,
                e.payload_crc32,
                e.base_crc32,
                e.crc32,
                e.part,
            ]
            for e in entries
        ],
    }
    hb = zstandard.ZstdCompressor(level=3).compress(json.dumps(head, separators=(",", ":")).encode())
    return b"".join([_PREFIX.pack(MAGIC, len(hb), crc32(hb)), hb, *payloads])


def read_header(blob: bytes | memoryview, *, with_payloads: bool = True) -> Header:
    """Parse and check the header; raises DeltaError on a damaged or truncated file.
    `with_payloads=False` reads a header fetched on its own (bytes up to `header_end`)."""
    blob = memoryview(blob)
    if len(blob) < _PREFIX.size:
        raise DeltaError("delta is truncated (no header)")
    magic, hlen, hcrc = _PREFIX.unpack(blob[: _PREFIX.size])
    if magic != MAGIC:
        raise DeltaError("not a strop delta file (bad magic)")
    hb = blob[_PREFIX.size : _PREFIX.size + hlen]
    if len(hb) < hlen:
        raise DeltaError("delta is truncated (inside the header)")
    if crc32(hb) != hcrc:
        raise DeltaError("delta header is corrupt (checksum mismatch)")
    head = json.loads(zstandard.ZstdDecompressor().decompress(hb))
    if head["format"] not in READABLE:
        raise DeltaError(f"delta format {head['format']} is not supported (this reader knows {READABLE})")
    entries = [Entry(n, m, d, tuple(s), o, ln, pc, bc, c, p) for n, m, d, s, o, ln, pc, bc, c, p in head["tensors"]]
    unknown = [e.name for e in entries if e.method not in METHODS]
    if unknown:
        raise DeltaError(f"delta header names an unknown method for {len(unknown)} tensors (damaged?)", unknown)
    h = Header(head["version"], head["base_version"], head["payload_bytes"], entries)
    have = len(blob) - _PREFIX.size - hlen
    if with_payloads and have > h.payload_bytes:
        raise DeltaError(f"delta has {have - h.payload_bytes} bytes past its {h.payload_bytes} payload bytes (damaged)")
    if with_payloads and have != h.payload_bytes:
        missing = [e.name for e in entries if e.length and e.offset + e.length > have]
        raise DeltaError(
            f"delta is truncated: {have} of {h.payload_bytes} payload bytes ({len(missing)} tensors incomplete)",
            missing,
        )
    return h


def payload_of(blob: bytes | memoryview, entry: Entry) -> memoryview:
    start = header_end(blob) + entry.offset
    return memoryview(blob)[start : start + entry.length]


def decode_changes(
    entry: Entry, base: Tensor | None, payload: memoryview, *, check_base: bool = True, apply: bool = False
) -> tuple[np.ndarray, np.ndarray] | Tensor | None:
    """What one entry does to its base tensor, *not yet verified against entry.crc32*:
    None (unchanged), (positions, new bit patterns) for a delta, or a whole new Tensor (for
    `full` and `xor`, and for a delta when `apply`: cheaper than scattering the changes into a
    copy afterwards)."""
    if crc32(payload) != entry.payload_crc32:
        raise DeltaError(f"tensor {entry.name!r}: payload is corrupt (checksum mismatch)", [entry.name])
    if entry.method == "full":
        try:
            return Tensor(
                entry.dtype,
                entry.shape,
                tc.decode_full(payload, bits_dtype(entry.dtype).itemsize, int(np.prod(entry.shape, dtype=np.int64))),
            )
        except ValueError as e:
            raise DeltaError(f"tensor {entry.name!r}: {e}", [entry.name]) from None
    if base is None or base.dtype != entry.dtype or base.shape != entry.shape:
        raise DeltaError(f"tensor {entry.name!r}: the base has no matching tensor (wrong base?)", [entry.name])
    if check_base and base.crc32() != entry.base_crc32:
        raise DeltaError(
            f"tensor {entry.name!r}: base tensor differs from the one this delta was made "
            "against (wrong base version?)",
            [entry.name],
        )
    if entry.method == "same":
        return None
    if entry.method == "xor":
        try:
            return Tensor(entry.dtype, entry.shape, tc.apply_xor(base.data, payload))
        except ValueError as e:
            raise DeltaError(f"tensor {entry.name!r}: {e}", [entry.name]) from None
    try:
        if apply:
            return Tensor(entry.dtype, entry.shape, tc.apply_delta(base.data, payload, entry.dtype))
        return tc.decode_delta(base.data, payload, entry.dtype)
    except (ValueError, IndexError) as e:  # the payload passed its checksum, so the base is off
        raise DeltaError(
            f"tensor {entry.name!r}: delta does not fit this base (wrong base?): {e}", [entry.name]
        ) from None


def decode_tensor(entry: Entry, base: Tensor | None, payload: memoryview, *, check_base: bool = True) -> Tensor:
    """The verified new tensor for one entry."""
    ch = decode_changes(entry, base, payload, check_base=check_base, apply=True)
    if ch is None and check_base:
        return base  # its crc was just checked, and for `same` the base crc is the result crc
    out = base if ch is None else ch
    if out.crc32() != entry.crc32:
        raise DeltaError(f"tensor {entry.name!r}: reconstructed tensor fails its checksum (wrong base?)", [entry.name])
    return out


def decode_group(
    members: list[Entry], base: StateDict, payload: memoryview, *, check_base: bool = True
) -> tuple[StateDict, list[str]]:
    """The new tensors of a group's members that verify against their crcs, and the names of
    those that do not. Raises DeltaError naming all members when the group cannot be decoded
    (corrupt payload, or a member's base missing or wrong)."""
    names = [e.name for e in members]
    if crc32(payload) != members[0].payload_crc32:
        raise DeltaError(f"tensors {names}: group payload is corrupt (checksum mismatch)", names)
    olds = [base.get(e.name) for e in members]
    for e, old in zip(members, olds):
        if old is None or old.dtype != e.dtype or old.shape != e.shape:
            raise DeltaError(f"tensor {e.name!r}: the base has no matching tensor (wrong base?)", names)
        if check_base and old.crc32() != e.base_crc32:
            raise DeltaError(
                f"tensor {e.name!r}: base tensor differs from the one this delta was made "
                "against (wrong base version?)",
                names,
            )
    data = np.concatenate([old.data for old in olds])
    try:
        tc.apply_delta(data, payload, members[0].dtype, out=data)
    except (ValueError, IndexError) as err:  # the payload passed its checksum, so the base is off
        raise DeltaError(f"tensors {names}: delta does not fit this base (wrong base?): {err}", names) from None
    out, bad = {}, []
    for e in members:
        t = Tensor(e.dtype, e.shape, data[e.part : e.part + e.size])
        if t.crc32() == e.crc32:
            out[e.name] = t
        else:
            bad.append(e.name)
    return out, bad


def decode(base: StateDict, blob: bytes | memoryview, *, check_base: bool = True) -> StateDict:
    """Apply a delta file to `base`; every tensor of the result is verified. Raises DeltaError
    listing every tensor that failed (after trying them all, so a repair can fetch just those)."""
    h = read_header(blob)
    out, failed, first = {}, [], None
    for unit in h.units():
        try:
            if unit[0].part is None:
                e = unit[0]
                out[e.name] = decode_tensor(e, base.get(e.name), payload_of(blob, e), check_base=check_base)
                continue
            good, bad = decode_group(unit, base, payload_of(blob, unit[0]), check_base=check_base)
            out.update(good)
            if bad:
                raise DeltaError(f"tensors {bad}: reconstructed tensors fail their checksums (wrong base?)", bad)
        except DeltaError as err:
            failed += err.tensors
            first = first or err
    if failed:
        more = f" (and {len(failed) - 1} more tensors)" if len(failed) > 1 else ""
        raise DeltaError(f"{first}{more}", failed)
    return out
