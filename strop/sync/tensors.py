"""Raw tensors as the codec sees them, and safetensors files read and written without torch.

A `Tensor` is a safetensors dtype name, a shape and the flat *bit patterns* of its elements as
an unsigned numpy array (bf16 -> uint16, fp32 -> uint32, bool/int8/fp8 -> uint8), so that
numpy, which has no bfloat16, can compare and patch weights bit-exactly. Files written here
load with `safetensors.torch.load_file`, and files written by it load here.
"""

import functools
import json
import math
import struct
from dataclasses import dataclass

import crc32c
import numpy as np

ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip


@dataclass
class Tensor:
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    data: np.ndarray  # flat, unsigned, one element per tensor element: the raw bits

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def crc32(self) -> int:
        return crc32(self.data)


StateDict = dict[str, Tensor]


def crc32(a: np.ndarray | bytes | memoryview) -> int:
    """CRC-32C (Castagnoli) of raw bytes: the CPU's crc32 instruction makes it ~4x faster than
    zlib's CRC-32 (13 vs 3.7 GB/s per core here), and every tensor of every version is hashed."""
    return crc32c.crc32c(np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a)


def bits_dtype(dtype: str) -> np.dtype:
    if dtype not in ITEMSIZE:
        raise ValueError(f"unsupported safetensors dtype {dtype!r}")
    return np.dtype(f"<u{ITEMSIZE[dtype]}")


def from_bytes(buf: bytes | memoryview) -> StateDict:
    """Parse a safetensors file's bytes; arrays are read-only views into `buf`."""
    buf = memoryview(buf)
    if len(buf) < 8:
        raise ValueError("not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", buf[:8])
    if 8 + n > len(buf):
        raise ValueError("not a safetensors file (header runs past the end)")
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    data = buf[8 + n :]
    out = {}
    for name, h in header.items():
        if not _well_formed(h):
            raise ValueError(f"safetensors entry {name!r} is malformed (needs dtype, shape and data_offsets)")
        begin, end = h["data_offsets"]
        dt = bits_dtype(h["dtype"])
        if not 0 <= begin <= end <= len(data) or (end - begin) != dt.itemsize * math.prod(h["shape"]):
            raise ValueError(f"safetensors entry {name!r} is truncated or inconsistent")
        out[name] = Tensor(h["dtype"], tuple(h["shape"]), np.frombuffer(data[begin:end], dtype=dt))
    return out


def _well_formed(h) -> bool:
    def naturals(v) -> bool:
        return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)

    return (
        isinstance(h, dict)
        and isinstance(h.get("dtype"), str)
        and naturals(h.get("shape"))
        and naturals(h.get("data_offsets"))
        and len(h["data_offsets"]) == 2
    )


def to_bytes(state: StateDict) -> bytes:
    """Serialise to the safetensors format (tensors in name order, header padded to 8 bytes)."""
    header, offset = {}, 0
    names = sorted(state)
    for name in names:
        t = state[name]
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return b"".join(
        [struct.pack("<Q", len(h)), h, *(memoryview(np.ascontiguousarray(state[k].data)).cast("B") for k in names)]
    )


def load(path: str) -> StateDict:
    with open(path, "rb") as f:
        return from_bytes(f.read())


def save(state: StateDict, path: str) -> None:
    with open(path, "wb") as f:
        f.write(to_bytes(state))


def crc32_combine(crc1: int, crc2: int, nbytes2: int) -> int:
    """`crc32` of A + B from crc1 = `crc32`(A), crc2 = `crc32`(B) and len(B) (zlib's crc32_combine,
    for CRC-32C): a whole tensor's checksum from the checksums of its pieces, without the bytes."""
    return _gf2_times(_zeros_operator(nbytes2), crc1) ^ crc2


def _gf2_times(mat: tuple[int, ...], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


@functools.cache
def _zeros_operator(nbytes: int) -> tuple[int, ...]:
    """The GF(2) matrix (column n: the image of bit n) that feeds `nbytes` zero bytes through a CRC-32C
    register; cached, since a tensor's pieces have the same sizes every version."""
    if nbytes == 0:
        return tuple(1 << n for n in range(32))
    if nbytes == 1:
        op = (0x82F63B78, *(1 << n for n in range(31)))  # one zero bit (reflected polynomial)
        for _ in range(3):  # 2, 4, 8 bits
            op = tuple(_gf2_times(op, c) for c in op)
        return op
    half = _zeros_operator(nbytes // 2)
    op = tuple(_gf2_times(half, c) for c in half)
    if nbytes % 2:
        one = _zeros_operator(1)
        op = tuple(_gf2_times(one, c) for c in op)
    return op
