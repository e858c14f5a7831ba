"""Vectorised bit-level primitives for the delta codec: Rice codes and fast set-bit positions.

Everything here is numpy over whole arrays — no per-element Python — because the codec must
run at hundreds of MB/s on one core. Two tools:

- **Rice codes** for non-negative integers (gaps between changed positions, step sizes). For
  geometrically distributed values, which gaps between independent changes are, a Rice code
  with the right parameter is within a few percent of the entropy, and unlike an arithmetic
  coder it splits into a unary bitmap and fixed-width remainders that numpy packs in bulk.
- **`nonzero`**, numpy's `flatnonzero` of a bool mask, steered onto its fast loop (see there).
"""

import numpy as np


class BitReader:
    """Sequential reader over a bytes payload, with bounds checks that turn truncation into
    a ValueError rather than silently short arrays."""

    def __init__(self, buf: bytes | memoryview):
        self.buf = memoryview(buf)
        self.pos = 0

    def varint(self) -> int:
        out, shift = 0, 0
        while True:
            if self.pos >= len(self.buf):
                raise ValueError("payload truncated inside a varint")
            b = self.buf[self.pos]
            self.pos += 1
            out |= (b & 0x7F) << shift
            if b < 0x80:
                return out
            shift += 7

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ValueError("payload truncated")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def bits(self, m: int) -> np.ndarray:
        """m packed bits (MSB first) as a uint8 array of 0/1."""
        return np.unpackbits(np.frombuffer(self.take((m + 7) // 8), dtype=np.uint8), count=m)


def varint(x: int) -> bytes:
    """LEB128: small header integers cost one or two bytes instead of eight."""
    assert x >= 0
    out = bytearray()
    while True:
        b = x & 0x7F
        x >>= 7
        if x:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


# numpy's flatnonzero of a bool array scans with memchr when at most 10% of it is set: fast
# when very sparse, but branch-bound (up to ~1.5 ns/element) at a few percent. Above 10% it
# runs a branchless loop (~0.5 ns/element). `mask_buffer` leaves room to pad a mask with set
# elements so that densities in between take the branchless loop.
_MEMCHR_MAX, _MEMCHR_FAST = 0.1, 0.03


def mask_buffer(n: int) -> np.ndarray:
    """A bool buffer for a mask of n elements (fill `buf[:n]`) with room for `nonzero`'s pad."""
    return np.empty(n + int(_MEMCHR_MAX * n / (1 - _MEMCHR_MAX)) + 64, dtype=bool)


def nonzero(buf: np.ndarray, n: int, m: int | None = None) -> np.ndarray:
    """Positions of the set elements of `buf[:n]` (a `mask_buffer`), sorted; `m` is their count
    when the caller knows it."""
    m = int(np.count_nonzero(buf[:n])) if m is None else m
    if m <= _MEMCHR_FAST * n or m > _MEMCHR_MAX * n:
        return np.flatnonzero(buf[:n])
    pad = int((_MEMCHR_MAX * n - m) / (1 - _MEMCHR_MAX)) + 64  # pushes the density past 10%
    buf[n : n + pad] = True
    return np.flatnonzero(buf[: n + pad])[:m]


def gaps(positions: np.ndarray) -> np.ndarray:
    """Zeros skipped before each of a sorted run of distinct positions (np.diff with a prepend
    allocates and broadcasts; this runs per class on every tensor)."""
    out = np.empty(len(positions), dtype=np.int64)
    if len(positions):
        out[0] = positions[0]
        np.subtract(positions[1:], positions[:-1], out=out[1:])
        out[1:] -= 1
    return out


def positions(gaps: np.ndarray) -> np.ndarray:
    """Inverse of `gaps`, in place (the gaps are not needed afterwards)."""
    gaps += 1
    np.cumsum(gaps, out=gaps)
    gaps -= 1
    return gaps


def rice_k(total: int, m: int) -> int:
    """Rice parameter for m values distributed about geometrically, from their sum alone:
    k = max(0, 1 + floor(log2(log(phi - 1) / log(theta)))), theta = mean / (mean + 1)
    (Kiely, "Selecting the Golomb parameter in Rice coding", IPN 42-159, 2004)."""
    mean = total / m if m else 0.0
    if mean < 0.5:
        return 0
    theta = mean / (mean + 1)
    return int(min(30, max(0, 1 + np.floor(np.log2(np.log(0.6180339887) / np.log(theta))))))


def _uint(k: int) -> type:
    """The narrowest unsigned dtype holding k-bit remainders (byte-wide ops are the cheapest)."""
    return np.uint8 if k <= 8 else np.uint16 if k <= 16 else np.uint32


def rice_encode(values: np.ndarray, total: int | None = None) -> bytes:
    """Rice-code non-negative integers (int64, overwritten): header (count, k, unary length),
    unary quotients as a bitmap with a 1 ending each quotient, then the k-bit remainders as
    bit planes, MSB first. `total` is values.sum() when the caller knows it (gaps of positions)."""
    m = len(values)
    if m == 0:
        return varint(0)
    k = rice_k(int(values.sum()) if total is None else total, m)
    r = values.astype(_uint(k)) if k else None  # remainders, taken before `values` is reused
    values >>= k  # in place: the quotients, then the unary code's end positions
    values += 1
    np.cumsum(values, out=values)
    unary = np.zeros(int(values[-1]) + 1, dtype=bool)
    unary[values] = True  # bit values[i] - 1 of unary[1:] ends quotient i
    parts = [varint(m), varint(k), varint(len(unary) - 1), np.packbits(unary[1:]).tobytes()]
    if k:
        # k bit planes: k cheap byte-wide passes instead of shuffling bits per value
        plane = np.empty_like(r)
        for b in reversed(range(k)):
            np.bitwise_and(r, r.dtype.type(1 << b), out=plane)
            parts.append(np.packbits(plane).tobytes())  # packbits takes any nonzero as a 1
    return b"".join(parts)


def rice_decode(reader: BitReader) -> np.ndarray:
    """Inverse of `rice_encode`, reading from `reader`; returns int64 values."""
    m = reader.varint()
    if m == 0:
        return np.zeros(0, dtype=np.int64)
    k = reader.varint()
    nbits = reader.varint()
    ends = np.flatnonzero(reader.bits(nbits).view(bool))  # numpy's bool nonzero is ~4x its uint8 one
    if len(ends) != m or k > 30:
        raise ValueError("corrupt Rice stream")
    q = gaps(ends)
    if not k:
        return q
    r = reader.bits(m).astype(_uint(k))
    for _ in range(k - 1):
        r <<= 1
        r |= reader.bits(m)
    q <<= k
    q |= r
    return q
