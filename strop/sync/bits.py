"""Vectorised bit-level primitives for the delta codec: Rice codes and rank/select on bitmaps.

Everything here is numpy over whole arrays — no per-element Python — because the codec must
run at hundreds of MB/s on one core. Two tools:

- **Rice codes** for non-negative integers (gaps between changed positions, step sizes). For
  geometrically distributed values, which gaps between independent changes are, a Rice code
  with the right parameter is within a few percent of the entropy, and unlike an arithmetic
  coder it splits into a unary bitmap and fixed-width remainders that numpy packs in bulk.
- **Rank/select** over packed bitmaps: the rank of position i among the set bits, and the
  position of the r-th set bit. The codec uses them to number the elements of one context
  class (e.g. "old exponent in [-12, -9)") without sorting the tensor.
"""

import numpy as np

# the position of the j-th set bit within each byte value (LSB first)
_SELECT8 = np.zeros((256, 8), dtype=np.uint8)
for _b in range(256):
    _set = [i for i in range(8) if _b >> i & 1]
    _SELECT8[_b, : len(_set)] = _set


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
    """Inverse of `gaps`."""
    out = np.cumsum(gaps)
    out += np.arange(1, len(gaps) + 1)
    out -= 1
    return out


def rice_k(values: np.ndarray) -> int:
    """Rice parameter for values distributed about geometrically, from their mean alone:
    k = max(0, 1 + floor(log2(log(phi - 1) / log(theta)))), theta = mean / (mean + 1)
    (Kiely, "Selecting the Golomb parameter in Rice coding", IPN 42-159, 2004)."""
    mean = float(values.mean()) if len(values) else 0.0
    if mean < 0.5:
        return 0
    theta = mean / (mean + 1)
    return int(min(30, max(0, 1 + np.floor(np.log2(np.log(0.6180339887) / np.log(theta))))))


def rice_encode(values: np.ndarray) -> bytes:
    """Rice-code non-negative integers: header (count, k, unary length), unary quotients as a
    bitmap with a 1 ending each quotient, then the k-bit remainders as bit planes."""
    values = np.asarray(values, dtype=np.int64)
    m = len(values)
    if m == 0:
        return varint(0)
    k = rice_k(values)
    ends = np.cumsum((values >> k) + 1) - 1
    unary = np.zeros(int(ends[-1]) + 1, dtype=bool)
    unary[ends] = True
    unary_b = np.packbits(unary)
    parts = [varint(m), varint(k), varint(len(unary)), unary_b.tobytes()]
    if k:
        # remainders as k bit planes, MSB first: k cheap passes instead of shuffling bits per value
        r = values.astype(np.uint32) if k > 16 else values.astype(np.uint16)
        for b in reversed(range(k)):
            parts.append(np.packbits((r >> b) & 1).tobytes())
    return b"".join(parts)


def rice_decode(reader: BitReader) -> np.ndarray:
    """Inverse of `rice_encode`, reading from `reader`; returns int64 values."""
    m = reader.varint()
    if m == 0:
        return np.zeros(0, dtype=np.int64)
    k = reader.varint()
    nbits = reader.varint()
    unary = np.unpackbits(np.frombuffer(reader.take((nbits + 7) // 8), dtype=np.uint8), count=nbits)
    ends = np.flatnonzero(unary)
    if len(ends) != m or k > 32:
        raise ValueError("corrupt Rice stream")
    q = gaps(ends)
    if not k:
        return q
    plane_bytes = (m + 7) // 8
    for _ in range(k):
        q <<= 1
        q |= np.unpackbits(np.frombuffer(reader.take(plane_bytes), dtype=np.uint8), count=m)
    return q


CHUNK = 1 << 16  # elements per step of the packing loop: temporaries stay in L2


def pack_below(u: np.ndarray, thresholds: list[int]) -> list[np.ndarray]:
    """For each threshold t, a packed bitmap (uint64 words, bit i = bit i%64 of word i//64) of
    the elements whose bits without the sign are < t, i.e. |x| < t. Chunked so that each
    element is read from memory once, however many thresholds."""
    n = len(u)
    nwords = (n + 63) // 64
    outs = [np.zeros(nwords * 8, dtype=np.uint8) for _ in thresholds]
    a2 = np.empty(min(CHUNK, n), dtype=u.dtype)
    tmp = np.empty(min(CHUNK, n), dtype=bool)
    for s in range(0, n, CHUNK) if thresholds else ():
        k = min(CHUNK, n - s)
        np.left_shift(u[s : s + k], 1, out=a2[:k])  # drop the sign bit: compare |x| << 1
        for out, t in zip(outs, thresholds):
            np.less(a2[:k], u.dtype.type(t << 1), out=tmp[:k])
            out[s // 8 : s // 8 + (k + 7) // 8] = np.packbits(tmp[:k], bitorder="little")
    return [o.view(np.uint64) for o in outs]


def prefix_counts(words: np.ndarray) -> np.ndarray:
    """before[w] = set bits in words < w (length len(words) + 1)."""
    out = np.zeros(len(words) + 1, dtype=np.int64)
    np.cumsum(np.bitwise_count(words), out=out[1:])
    return out


class NestedClasses:
    """Rank/select within the classes of a partition defined by nested bitmaps.

    `below[j]` marks the elements of classes 0..j (each set contains the previous one), so
    class c is set c+1 minus set c, where set 0 is empty and the last set is everything, and
    a rank within class c is a difference of two plain ranks. Only the nested bitmaps are
    built over the whole tensor; a class's own words are formed for the queried words only."""

    def __init__(self, n: int, below: list[np.ndarray]):
        nwords = (n + 63) // 64
        self.words: list[np.ndarray | None] = [None, *below, None]  # None: empty / everything
        self.before = [np.zeros(nwords + 1, dtype=np.int64), *(prefix_counts(w) for w in below)]
        self.before.append(np.arange(nwords + 1, dtype=np.int64) * 64)
        self.sizes = [0, *(int(b[-1]) for b in self.before[1:-1]), n]

    def _words(self, s: int, w: np.ndarray) -> np.ndarray:
        words = self.words[s]
        if words is None:
            return np.full(len(w), ~np.uint64(0) if s else np.uint64(0))
        return words[w]

    def _rank(self, s: int, pos: np.ndarray) -> np.ndarray:
        w = pos >> 6
        mask = (np.uint64(1) << (pos & 63).astype(np.uint64)) - np.uint64(1)
        return self.before[s][w] + np.bitwise_count(self._words(s, w) & mask)

    def count(self, c: int) -> int:
        return self.sizes[c + 1] - self.sizes[c]

    def rank(self, c: int, pos: np.ndarray) -> np.ndarray:
        """Number of class-c elements strictly before each position."""
        return self._rank(c + 1, pos) - self._rank(c, pos)

    def select(self, c: int, ranks: np.ndarray) -> np.ndarray:
        """Position of the class-c element with each rank; ranks must be < count(c)."""
        before = self.before[c + 1] - self.before[c] if c else self.before[1]
        if len(ranks) > len(before):
            # more queries than words: search the words among the queries instead (sorted
            # ranks make per-word query counts; repeating word ids gives each query its word)
            per_word = np.diff(np.searchsorted(ranks, before[1:]), prepend=0)
            w = np.repeat(np.arange(len(before) - 1), per_word)
        else:
            w = np.searchsorted(before, ranks, side="right") - 1
        j = (ranks - before[w]).astype(np.uint64)
        return (w << 6) + select_in_word(self._words(c + 1, w) & ~self._words(c, w), j)


def select_in_word(x: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Index of the j-th set bit (0-based, LSB first) of each 64-bit word, j < popcount.

    The branch-free broadword select of Vigna ("Broadword implementation of rank/select
    queries", 2008), vectorised over all queries."""
    s = x - ((x >> _1) & _M1)
    s = (s & _M2) + ((s >> _2) & _M2)
    s = (s + (s >> _4)) & _M4
    sums = s * _L8  # byte i: set bits in bytes 0..i
    place = np.bitwise_count(((j * _L8) | _H8) - sums & _H8).astype(np.uint64) * _8
    before = ((sums << _8) >> place) & _FF
    return place.astype(np.int64) + _SELECT8[(x >> place) & _FF, j - before]


_1, _2, _4, _8, _FF = (np.uint64(v) for v in (1, 2, 4, 8, 0xFF))
_M1, _M2, _M4 = np.uint64(0x5555555555555555), np.uint64(0x3333333333333333), np.uint64(0x0F0F0F0F0F0F0F0F)
_L8, _H8 = np.uint64(0x0101010101010101), np.uint64(0x8080808080808080)
