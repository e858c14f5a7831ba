"""A version in pieces: each rank of a sharded trainer publishes its own shard of every tensor.

A piece is the flat element range [start, stop) of one tensor, named `name[start:stop]` (a
sharded trainer's ranks each hold a contiguous range of rows, so of elements). A rank's piece of
a version is an ordinary delta file (`codec`) over its pieces, against its own previous pieces
(the first version of a chain: an ordinary safetensors file of them); the version's manifest
names the pieces by count and holds each *whole* tensor's checksum, combined from the pieces'
(`tensors.crc32_combine`), so no rank ever holds the whole model.

Delta files are self-delimiting, so a version's pieces travel as one body, back to back, through
the origin and relays like any delta. A receiver cuts its copy of each tensor into the ranges a
piece file names, decodes, writes the pieces back into whole tensors and verifies every whole
tensor against the manifest. A tensor a missing or damaged piece fails to deliver is repaired
like one of a damaged delta: fetched whole.
"""

import numpy as np

from strop.sync import codec
from strop.sync.tensors import StateDict, Tensor, crc32_combine


def piece_name(name: str, start: int, stop: int) -> str:
    return f"{name}[{start}:{stop}]"


def parse(key: str) -> tuple[str, int, int | None]:
    """(tensor name, start, stop) of a piece; a whole tensor's name is (name, 0, None)."""
    if not key.endswith("]") or "[" not in key:
        return key, 0, None
    name, _, span = key[:-1].rpartition("[")
    start, stop = span.split(":")
    return name, int(start), int(stop)


def is_pieced(blob: bytes | memoryview) -> bool:
    """Whether a delta body holds pieces (False for one ordinary delta, or a damaged header)."""
    try:
        h = codec.read_header(memoryview(blob)[: max(codec.PREFIX_SIZE, _end(blob))], with_payloads=False)
    except codec.DeltaError:
        return False
    return any(parse(e.name)[2] is not None for e in h.entries)


def _end(blob: bytes | memoryview) -> int:
    return codec.header_end(blob) if len(blob) >= codec.PREFIX_SIZE else 0


def split(blob: bytes | memoryview) -> list[memoryview]:
    """The delta files of a body, back to back; a truncated last one as far as it goes. Stops at
    a header it cannot read (what follows cannot be found): the pieces there go unrepaired here,
    so their tensors are repaired whole."""
    blob, out, at = memoryview(blob), [], 0
    while at < len(blob):
        rest = blob[at:]
        try:
            h = codec.read_header(rest[: _end(rest)], with_payloads=False)
        except codec.DeltaError:
            break
        end = codec.header_end(rest) + h.payload_bytes
        out.append(rest[:end])
        at += end
    return out


def cut(state: StateDict, keys: list[str]) -> StateDict:
    """The base each key of a piece file applies to: a whole tensor itself, a piece a view of its
    range (absent where the tensor is, or the range does not fit it)."""
    out = {}
    for key in keys:
        name, start, stop = parse(key)
        t = state.get(name)
        if t is None:
            continue
        if stop is None:
            out[key] = t
        elif stop <= len(t.data):
            out[key] = Tensor(t.dtype, (stop - start,), t.data[start:stop])
    return out


def paste(state: StateDict, decoded: StateDict) -> StateDict:
    """`state` with decoded pieces written into (copies of) their whole tensors."""
    out, copied = dict(state), set()
    for key, piece in decoded.items():
        name, start, stop = parse(key)
        if name not in copied:
            t = out[name]
            out[name] = Tensor(t.dtype, t.shape, t.data.copy())
            copied.add(name)
        out[name].data[start:stop] = piece.data
    return out


def decode(base: StateDict, blob: bytes | memoryview, crcs: dict[str, int]) -> StateDict:
    """Apply a version's pieces to `base`: every tensor of `crcs` (the version's manifest), each
    verified against its checksum. Raises DeltaError naming the tensors that fail."""
    state = base
    for f in split(blob):
        h = codec.read_header(f)
        state = paste(state, codec.decode(cut(state, [e.name for e in h.entries]), f, check_base=False))
    bad = [k for k, c in crcs.items() if k not in state or state[k].crc32() != c]
    if bad:
        raise codec.DeltaError(f"tensors {bad} fail their checksums after the version's pieces", bad)
    return {k: state[k] for k in crcs}


def whole_crcs(pieces: dict[str, tuple[int, int]], sizes: dict[str, int]) -> dict[str, int]:
    """Each whole tensor's crc from its pieces' (key -> (crc, bytes)); `sizes`: each tensor's
    element count, which its pieces must cover exactly (asserted)."""
    by_name: dict[str, list[tuple[int, int, int, int]]] = {}
    for key, (crc, nbytes) in pieces.items():
        name, start, stop = parse(key)
        by_name.setdefault(name, []).append((start, stop, crc, nbytes))
    out = {}
    for name, parts in by_name.items():
        parts.sort()
        assert [p[0] for p in parts[1:]] == [p[1] for p in parts[:-1]], f"{name}: pieces overlap or leave gaps"
        assert parts[0][0] == 0 and parts[-1][1] == sizes[name], f"{name}: pieces do not cover the tensor"
        crc = parts[0][2]
        for _, _, c, nbytes in parts[1:]:
            crc = crc32_combine(crc, c, nbytes)
        out[name] = crc
    return out


def snapshot(files: list[StateDict], shapes: dict[str, tuple[int, ...]]) -> StateDict:
    """Whole tensors from snapshot pieces (each file a rank's pieces), shaped as `shapes` says."""
    parts: dict[str, list[tuple[int, Tensor]]] = {}
    for f in files:
        for key, t in f.items():
            name, start, _ = parse(key)
            parts.setdefault(name, []).append((start, t))
    out = {}
    for name, ps in parts.items():
        ps.sort(key=lambda p: p[0])
        data = np.concatenate([t.data for _, t in ps])
        assert len(data) == int(np.prod(shapes[name], dtype=np.int64)), f"{name}: pieces do not cover the tensor"
        out[name] = Tensor(ps[0][1].dtype, tuple(shapes[name]), data)
    return out
