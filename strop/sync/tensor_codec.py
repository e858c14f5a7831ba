"""Lossless delta of one floating-point tensor against its previous version.

The receiver already holds the old tensor, so the encoder only has to say *which* elements
changed and *by how much*, in terms the receiver can predict from what it holds:

- **Where.** Whether a weight changes in one RL step depends mostly on its old exponent: an
  Adam step has roughly the same size everywhere, and the bf16 rounding grid is 2x finer for
  each halving of |w|, so small weights change far more often. The elements are split into
  two classes at an old-exponent bound (chosen per tensor from a sample, sent in the
  payload); within each class, changes are close to independent coin flips, so the gaps
  between changes are geometric and Rice-coded. In the low class (small weights: a few
  percent of the elements, changing often) gaps count class members only: the encoder ranks
  its changes by popcount over a packed bitmap of the class, the decoder lists the members
  with one compare and one `nonzero`. The top class (large weights: most of the elements,
  changing rarely) is coded by plain position, which costs log2(1/its share) ≈ 0.1-0.3 bits
  a change and spares rank and select over most of the tensor. (A third class saved ~3% of
  the size for more passes over the changes.)
- **By how much.** Each change is a signed step in the monotone integer order of the float
  format (`order_key`): almost all steps are ±1 ulp. For all changes, class by class: a sign bit, the
  positions of the rare |step| > 1 as Rice-coded gaps, and their sizes Rice-coded.

Steps are taken modulo 2^bits, so every bit pattern (NaN, inf, -0) round-trips exactly.
Tensors that change densely (most elements, as one AdamW step at a pretraining learning rate
moves them) go as the zstd'd byte planes of old XOR new (`encode_xor`), and tensors with no
usable base as a zstd'd byte-shuffled full copy (`encode_full`).

This module is the format's reference, in numpy. When a C compiler is at hand the per-change
work runs in C instead (`native_coder`), producing the same bytes.
"""

from collections.abc import Iterator

import numpy as np
import zstandard

from strop.sync import native_coder
from strop.sync.bits import BitReader, gaps, mask_buffer, nonzero, positions, rice_decode, rice_encode, varint

# safetensors dtype -> (mantissa bits, exponent bits); only these get deltas
FLOATS: dict[str, tuple[int, int]] = {"BF16": (7, 8), "F16": (10, 5), "F32": (23, 8)}
CLASS_COST_BITS = 256  # header bytes plus the extra passes, priced as bits
SAMPLE = 1 << 14  # elements sampled to estimate the exponent histograms (enough to place one bound)
# above this fraction of changed elements `encode_xor` is smaller than `encode_delta`, or within 1%, on
# AdamW steps (SmolLM2's real lr-3e-4 update: a 12.25 MB delta file at 0.6, 12.23 MB at 0.7 or 0.8)
XOR_ABOVE = 0.6


def order_key(u: np.ndarray) -> np.ndarray:
    """Map float bit patterns to unsigned integers in float order (-0 < +0), up to a constant
    offset of 2^(bits-1) that cancels in differences: negatives get their magnitude bits
    flipped. Its own inverse (the sign bit is kept), so steps are added in key space."""
    flip = u >> (u.itemsize * 8 - 1)
    flip *= u.dtype.type((1 << (u.itemsize * 8 - 1)) - 1)  # 0 or 0x7F..F
    flip ^= u
    return flip


def sample_blocks(a: np.ndarray, block: int = 4096) -> np.ndarray:
    """About SAMPLE elements in evenly spaced contiguous blocks (a strided sample would touch
    every cache line of the tensor)."""
    nblocks = len(a) // block
    if len(a) <= SAMPLE or nblocks < 2:
        return a
    step = max(1, nblocks // max(1, SAMPLE // block))
    return a[: nblocks * block].reshape(nblocks, block)[::step][: max(1, SAMPLE // block)].ravel()


def _mask_bits(n: np.ndarray, m: np.ndarray) -> np.ndarray:
    """n·H(m/n): bits to code which m of n elements changed, if they change independently
    (p clamped away from 0 and 1 rather than special-cased: an estimate needs no exact zeros)."""
    n = np.maximum(n, 1.0)
    p = np.minimum(np.maximum(m / n, 1e-12), 1 - 1e-12)
    return n * -(p * np.log2(p) + (1 - p) * np.log2(1 - p))


def choose_bound(old: np.ndarray, new: np.ndarray, mant: int, exp_bits: int) -> int | None:
    """The exponent b splitting the elements into a low class (old exponent < b, coded by rank
    among its members) and a top class (coded by position), or None for one class. Minimises
    the estimated bits of the change mask, n_low·H(p_low) + N·H(m_top/N), plus a price for
    the extra class. The histograms come from a block sample: cheap on big tensors, and a
    dozen numpy calls on small ones."""
    sample, sample_new = sample_blocks(old), sample_blocks(new)
    exps = sample & sample.dtype.type((1 << (sample.itemsize * 8 - 1)) - 1)
    exps >>= mant
    cn = np.cumsum(np.bincount(exps, minlength=1 << exp_bits))  # cn[i]: exponent <= i
    cm = np.cumsum(np.bincount(np.compress(sample != sample_new, exps), minlength=1 << exp_bits))
    # bits[i]: the low class is exponents 0..i (bound i + 1), the top class the rest
    bits = _mask_bits(cn, cm) + _mask_bits(cn[-1], cm[-1] - cm)
    bits += CLASS_COST_BITS * len(sample) / len(old)  # the price is per tensor, the bits per sample
    bits[cn == cn[-1]] = np.inf  # the top class is never empty
    i = int(bits.argmin())
    return i + 1 if bits[i] < _mask_bits(cn[-1], cm[-1]) else None


CHUNK = 1 << 18  # elements per step of `_low_chunks`: its temporaries stay in cache
_BELOW = np.array([(1 << i) - 1 for i in range(64)], dtype=np.uint64)  # bits below bit i


def _low_chunks(old: np.ndarray, bound: int, mant: int) -> Iterator[tuple[int, int, np.ndarray]]:
    """(start, length, mask buffer) per CHUNK of `old`, the buffer's first `length` entries
    marking the low class's members (old exponent below `bound`). One buffer serves every
    chunk: whole-tensor temporaries would cost more in fresh pages than the compare itself."""
    n = len(old)
    absmask, t = old.dtype.type((1 << (old.itemsize * 8 - 1)) - 1), old.dtype.type(bound << mant)
    a = np.empty(min(n, CHUNK), dtype=old.dtype)
    mask = mask_buffer(min(n, CHUNK))
    for s in range(0, n, CHUNK):
        k = min(CHUNK, n - s)
        np.bitwise_and(old[s : s + k], absmask, out=a[:k])
        np.less(a[:k], t, out=mask[:k])
        yield s, k, mask


def _low_class(old: np.ndarray, bound: int, mant: int) -> np.ndarray:
    """Sorted positions of the low class's members."""
    parts = []
    for s, k, mask in _low_chunks(old, bound, mant):
        found = nonzero(mask, k)
        found += s
        parts.append(found)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _low_ranks(old: np.ndarray, bound: int, mant: int, pos: np.ndarray) -> np.ndarray:
    """For sorted positions of low-class elements, their ranks among the low class's members:
    a packed bitmap of the class, prefix popcounts per 64-bit word, and a popcount within each
    position's word. Cheaper than listing the members when most of the tensor is not in the
    class."""
    packed = np.zeros((len(old) + 63) // 64 * 8, dtype=np.uint8)
    for s, k, mask in _low_chunks(old, bound, mant):  # CHUNK is a multiple of 8: whole bytes
        packed[s // 8 : s // 8 + (k + 7) // 8] = np.packbits(mask[:k], bitorder="little")
    words = packed.view(np.uint64)  # bit j of word w: element 64w + j (little-endian)
    before = np.zeros(len(words), dtype=np.int64)
    np.cumsum(np.bitwise_count(words)[:-1], out=before[1:])
    w = pos >> 6
    below = _BELOW[pos & 63]  # a table lookup: numpy's uint64 shift by an array is slow
    below &= words[w]
    ranks = np.bitwise_count(below).astype(np.int64)
    ranks += before[w]
    return ranks


def _encode_coords(coords: np.ndarray) -> bytes:
    """Gaps between one class's sorted change coordinates (ranks among the low class's
    members, or positions in the tensor for the top class)."""
    m = len(coords)
    return rice_encode(gaps(coords), int(coords[-1]) - m + 1) if m else rice_encode(coords)


def _encode_steps(d: np.ndarray) -> list[bytes]:
    """Signs and sizes of the ordinal steps `d` (overwritten) of every change, class by class.
    One stream serves all classes: they differ in how often |step| > 1, and the gaps between
    such escapes say that as well in one stream as in one per class, for half the calls."""
    if not len(d):
        return []
    signed = d.view(f"i{d.itemsize}")
    out = [np.packbits(signed < 0).tobytes()]
    np.abs(signed, out=signed)  # |step| (-2^(bits-1) stays itself, which read unsigned is its size)
    esc = np.flatnonzero(d != 1)  # |step| > 1
    out.append(rice_encode(gaps(esc), int(esc[-1]) - len(esc) + 1 if len(esc) else 0))
    big = d[esc].astype(np.int64)
    big -= 2
    out.append(rice_encode(big))
    return out


def _native(*arrays: np.ndarray) -> bool:
    """Whether the C coder can take these arrays: flat C buffers of 2- or 4-byte bit patterns."""
    return native_coder.available() and all(a.flags.c_contiguous and a.itemsize in (2, 4) for a in arrays)


def count_changes(old: np.ndarray, new: np.ndarray, with_mask: bool = True) -> tuple[np.ndarray | None, int]:
    """(mask, count) of the elements that differ: the mask is a `bits.mask_buffer` for the numpy
    coder, None when `with_mask` is false or the C coder (which needs none) will run."""
    n = len(old)
    if _native(old, new):
        return None, native_coder.count_changes(old, new)
    changed = mask_buffer(n) if with_mask else None
    return changed, int(np.count_nonzero(np.not_equal(old, new, out=None if changed is None else changed[:n])))


def encode_delta(
    old: np.ndarray, new: np.ndarray, dtype: str, changed: np.ndarray | None = None, m: int | None = None
) -> bytes:
    """Delta payload turning `old` into `new` (flat unsigned views of one float dtype).
    `changed` may pass the caller's `old != new` in a `bits.mask_buffer`, and `m` its count."""
    mant, exp_bits = FLOATS[dtype]
    n = len(old)
    if _native(old, new):
        m = native_coder.count_changes(old, new) if m is None else m
        return native_coder.encode_delta(old, new, choose_bound(old, new, mant, exp_bits), mant, m)
    if changed is None:
        changed = mask_buffer(n)
        np.not_equal(old, new, out=changed[:n])
    pos = nonzero(changed, n, m)
    ov = old[pos]
    d = order_key(new[pos])
    d -= order_key(ov)  # the steps modulo 2^bits
    bound = choose_bound(old, new, mant, exp_bits)
    if bound is None:
        return b"".join([varint(0), _encode_coords(pos), *_encode_steps(d)])
    ov &= ov.dtype.type((1 << (ov.itemsize * 8 - 1)) - 1)
    low = ov < ov.dtype.type(bound << mant)
    top = ~low
    ranks = _low_ranks(old, bound, mant, np.compress(low, pos))
    steps = np.concatenate([np.compress(low, d), np.compress(top, d)])
    return b"".join(
        [varint(1), varint(bound), _encode_coords(ranks), _encode_coords(np.compress(top, pos)), *_encode_steps(steps)]
    )


def _decode_coords(r: BitReader, limit: int) -> np.ndarray:
    """One class's sorted change coordinates, each below `limit`."""
    coords = positions(rice_decode(r))
    if len(coords) and coords[-1] >= limit:
        raise ValueError("corrupt delta: change outside its class")
    return coords


def _decode_steps(r: BitReader, m: int, dtype: np.dtype) -> np.ndarray:
    """The ordinal steps of m changes (modulo 2^bits)."""
    if not m:
        return np.zeros(0, dtype=dtype)
    sign = r.bits(m).astype(dtype)
    esc = positions(rice_decode(r))
    big = rice_decode(r)
    if len(big) != len(esc) or (len(esc) and esc[-1] >= m):
        raise ValueError("corrupt delta: bad step stream")
    d = np.ones(m, dtype=dtype)
    big += 2
    d[esc] = big.astype(dtype)  # sizes wrap modulo 2^bits, as encoded
    np.negative(sign, out=sign)  # 0 or all ones: the step is (d ^ sign) - sign
    d ^= sign
    d -= sign
    return d


def decode_delta(old: np.ndarray, payload: bytes | memoryview, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Changed positions (int64, sorted within each class) and their new bit patterns, from
    `old` and a delta payload.

    Raises ValueError when the payload is malformed (the caller's checksums catch the rest)."""
    mant, exp_bits = FLOATS[dtype]
    if _native(old):
        return native_coder.decode_delta(old, payload, mant, exp_bits)
    r = BitReader(payload)
    nb = r.varint()
    if nb > 1:
        raise ValueError("corrupt delta: too many classes")
    if nb:
        bound = r.varint()
        if bound >= 1 << exp_bits:
            raise ValueError("corrupt delta: bad class bound")
        members = _low_class(old, bound, mant)
        pos = members[_decode_coords(r, len(members))]
        top = _decode_coords(r, len(old))
        if len(top):
            pos = np.concatenate([pos, top])
    else:
        pos = _decode_coords(r, len(old))
    d = _decode_steps(r, len(pos), old.dtype)
    if r.pos != len(r.buf):
        raise ValueError("corrupt delta: trailing bytes")
    vals = order_key(old[pos])
    vals += d
    return pos, order_key(vals)


def apply_delta(old: np.ndarray, payload: bytes | memoryview, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """`old` with a delta payload applied, into `out` (a new copy by default; `old` itself
    updates it in place). Raises ValueError like `decode_delta`, leaving `out` untouched."""
    out = old.copy() if out is None else out
    if _native(old, out):
        mant, exp_bits = FLOATS[dtype]
        native_coder.decode_delta(old, payload, mant, exp_bits, out)  # no positions and values to scatter
    else:
        pos, vals = decode_delta(old, payload, dtype)
        out[pos] = vals
    return out


def _planes(data: np.ndarray) -> np.ndarray:
    """The byte planes of flat unsigned integers, least significant first (bytes j of every element,
    then j + 1...): shifts and narrowing copies, ~10x faster than transposing a byte view."""
    n = len(data)
    out = np.empty(data.itemsize * n, dtype=np.uint8)
    shifted = np.empty_like(data)
    for j in range(data.itemsize):
        np.right_shift(data, j * 8, out=shifted)
        np.copyto(out[j * n : (j + 1) * n], shifted, casting="unsafe")  # keeps the low byte
    return out


def _join_planes(planes: np.ndarray, itemsize: int) -> np.ndarray:
    """Inverse of `_planes`."""
    n = len(planes) // itemsize
    out = planes[(itemsize - 1) * n :].astype(f"<u{itemsize}")
    for j in reversed(range(itemsize - 1)):
        out <<= 8
        out |= planes[j * n : (j + 1) * n]
    return out


def encode_full(data: np.ndarray, level: int = 3) -> bytes:
    """zstd of the byte planes (all low bytes, then the next...): exponents compress."""
    return zstandard.ZstdCompressor(level=level).compress(_planes(data))


def decode_full(payload: bytes | memoryview, itemsize: int, n: int) -> np.ndarray:
    try:
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=n * itemsize)
    except zstandard.ZstdError as e:
        raise ValueError(f"corrupt full copy: {e}") from None
    if len(raw) != n * itemsize:
        raise ValueError("corrupt full copy: wrong size")
    return _join_planes(np.frombuffer(raw, dtype=np.uint8), itemsize)


def encode_xor(old: np.ndarray, new: np.ndarray) -> bytes:
    """`encode_full` of old XOR new: for a dense change by small steps the sign, the exponent and
    the high mantissa bits mostly stay, so the high planes are runs of zeros and only the low
    plane carries the change. zstd level 1: on such planes both faster and smaller than level 3
    (dense AdamW steps of SmolLM2 and of `synthetic`: 5-9% smaller at 1.7-2.3x the speed)."""
    return encode_full(np.bitwise_xor(old, new), level=1)


def apply_xor(old: np.ndarray, payload: bytes | memoryview) -> np.ndarray:
    """The new tensor from `old` and an `encode_xor` payload. Raises ValueError like `decode_full`."""
    out = decode_full(payload, old.itemsize, len(old))
    out ^= old
    return out
