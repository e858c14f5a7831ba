"""Lossless delta of one floating-point tensor against its previous version.

The receiver already holds the old tensor, so the encoder only has to say *which* elements
changed and *by how much*, in terms the receiver can predict from what it holds:

- **Where.** Whether a weight changes in one RL step depends mostly on its old exponent: an
  Adam step has roughly the same size everywhere, and the bf16 rounding grid is 2x finer for
  each halving of |w|, so small weights change far more often. The elements are split into a
  few classes by old exponent range (the boundaries are chosen per tensor by a small dynamic
  program and sent in the payload); within each class, changes are close to independent
  coin flips, so the gaps between changed *class ranks* are geometric and Rice-coded. Class
  ranks come from rank/select over nested packed bitmaps (`bits.NestedClasses`): one
  compare-and-pack per class boundary on each chunk of the tensor, no sort.
- **By how much.** Each change is a signed step in the monotone integer order of the float
  format ("ordinal space"): almost all steps are ±1 ulp. Per class: a sign bit per change,
  the positions of the rare |step| > 1 as Rice-coded gaps, and their sizes Rice-coded.

Steps are taken modulo 2^bits, so every bit pattern (NaN, inf, -0) round-trips exactly.
Tensors that change densely fall back to a zstd'd byte-shuffled full copy (`encode_full`).
"""

import numpy as np
import zstandard

from strop.sync.bits import BitReader, NestedClasses, gaps, pack_below, positions, rice_decode, rice_encode, varint

# safetensors dtype -> (mantissa bits, exponent bits); only these get deltas
FLOATS: dict[str, tuple[int, int]] = {"BF16": (7, 8), "F16": (10, 5), "F32": (23, 8)}
MAX_CLASSES = 3  # each more class saves ~1-2% in size and costs one more pass over the tensor
CLASS_COST_BITS = 256  # header bytes plus one extra pass over the tensor, priced as bits
SAMPLE = 1 << 16  # elements sampled to estimate the exponent histograms (plenty to place 2 bounds)
DENSE = 0.4  # above this fraction of changed elements a full copy is usually smaller


def _signed(u: type) -> type:
    return np.int16 if u is np.uint16 else np.int32


def to_ordinal(u: np.ndarray) -> np.ndarray:
    """Map float bit patterns to unsigned integers whose order is the float order (-0 < +0):
    flip the sign bit of positives, all bits of negatives."""
    shift = u.itemsize * 8 - 1
    flip = u >> shift
    flip *= u.dtype.type((1 << shift) - 1)  # 0 or 0x7F..F
    flip |= u.dtype.type(1 << shift)  # 0x80..0 or 0xFF..F
    flip ^= u
    return flip


def from_ordinal(k: np.ndarray) -> np.ndarray:
    shift = k.itemsize * 8 - 1
    flip = (k >> shift) ^ k.dtype.type(1)  # 1 for negatives
    flip *= k.dtype.type((1 << shift) - 1)
    flip |= k.dtype.type(1 << shift)
    flip ^= k
    return flip


def sample_blocks(a: np.ndarray, block: int = 4096) -> np.ndarray:
    """About SAMPLE elements in evenly spaced contiguous blocks (a strided sample would touch
    every cache line of the tensor)."""
    nblocks = len(a) // block
    if len(a) <= SAMPLE or nblocks < 2:
        return a
    take = np.linspace(0, nblocks - 1, max(1, SAMPLE // block)).astype(np.int64)
    return a[: nblocks * block].reshape(nblocks, block)[take].ravel()


def _mask_bits(n: np.ndarray, m: np.ndarray) -> np.ndarray:
    """n·H(m/n): bits to code which m of n elements changed, if they change independently."""
    n = np.maximum(n, m)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = m / n
        h = -(p * np.log2(p) + (1 - p) * np.log2(1 - p))
    return np.where((m > 0) & (m < n), n * h, 0.0)


def choose_bounds(old: np.ndarray, new: np.ndarray, mant: int, exp_bits: int) -> list[int]:
    """Exponent boundaries b_1 < ... splitting elements into classes [b_j, b_j+1) that minimise
    the estimated bits of the change mask (sum of n_c·H(p_c)) plus a per-class price. The
    histograms come from an evenly strided sample, so this costs nothing on big tensors."""
    n_exp = 1 << exp_bits
    sample, sample_new = sample_blocks(old), sample_blocks(new)
    absmask = sample.dtype.type((1 << (sample.itemsize * 8 - 1)) - 1)
    exps = (sample & absmask) >> mant
    scale = len(old) / len(sample)
    counts = np.bincount(exps, minlength=n_exp) * scale
    changes = np.bincount(exps[sample != sample_new], minlength=n_exp) * scale
    live = np.flatnonzero((counts > 0) | (changes > 0))
    if len(live) < 2:
        return []
    cn = np.concatenate([[0], np.cumsum(counts[live])])
    cm = np.concatenate([[0], np.cumsum(changes[live])])
    L = len(live)
    # cost[i, j]: one class made of live bins i..j-1 (inf unless i < j)
    i, j = np.triu_indices(L + 1, 1)
    cost = np.full((L + 1, L + 1), np.inf)
    cost[i, j] = _mask_bits(cn[j] - cn[i], cm[j] - cm[i]) + CLASS_COST_BITS
    best = [np.full(L + 1, np.inf)]  # best[k][j]: cheapest split of bins [0, j) into k classes
    best[0][0] = 0.0
    back = [None]
    for _ in range(MAX_CLASSES):
        total = best[-1][:, None] + cost
        back.append(total.argmin(axis=0))
        best.append(total.min(axis=0))
    k = min(range(1, MAX_CLASSES + 1), key=lambda k: best[k][L])
    cuts, j = [], L
    while k > 1:
        j = int(back[k][j])
        cuts.append(int(live[j]))
        k -= 1
    return sorted(cuts)


def _classes(old: np.ndarray, bounds: list[int], mant: int) -> NestedClasses:
    """Class c holds the elements whose old exponent lies in [bounds[c-1], bounds[c])."""
    return NestedClasses(len(old), pack_below(old, [b << mant for b in bounds]))


def encode_delta(old: np.ndarray, new: np.ndarray, dtype: str, idx: np.ndarray | None = None) -> bytes:
    """Delta payload turning `old` into `new` (flat unsigned views of one float dtype).
    `idx` (the sorted changed positions) may be passed when the caller has computed it."""
    mant, exp_bits = FLOATS[dtype]
    if idx is None:
        idx = np.flatnonzero(old != new)
    bounds = choose_bounds(old, new, mant, exp_bits)
    classes = _classes(old, bounds, mant)
    ov, nv = old[idx], new[idx]
    sdt = _signed(old.dtype.type)
    step = (to_ordinal(nv) - to_ordinal(ov)).view(sdt).astype(np.int64)
    absmask = old.dtype.type((1 << (old.itemsize * 8 - 1)) - 1)
    exp = (ov & absmask) >> mant
    class_of_exp = np.zeros(1 << exp_bits, dtype=np.uint8)
    for b in bounds:
        class_of_exp[b:] += 1
    cls = class_of_exp[exp]
    order = np.argsort(cls, kind="stable")  # groups changes by class, positions stay sorted
    ends = np.cumsum(np.bincount(cls, minlength=len(bounds) + 1))
    parts = [varint(len(bounds))] + [varint(b) for b in bounds]
    for c in range(len(bounds) + 1):
        sel = order[(ends[c - 1] if c else 0) : ends[c]]
        if not len(sel):
            parts.append(rice_encode(sel))
            continue
        ranks = classes.rank(c, idx[sel])
        parts.append(rice_encode(gaps(ranks)))
        s = step[sel]
        parts.append(np.packbits(s < 0).tobytes())
        mag = np.abs(s) - 1
        esc = np.flatnonzero(mag)
        parts.append(rice_encode(gaps(esc)))
        parts.append(rice_encode(mag[esc] - 1))
    return b"".join(parts)


def decode_delta(old: np.ndarray, payload: bytes | memoryview, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Changed positions (int64) and their new bit patterns, from `old` and a delta payload.

    Raises ValueError when the payload is malformed (the caller's checksums catch the rest)."""
    mant, exp_bits = FLOATS[dtype]
    r = BitReader(payload)
    nb = r.varint()
    if nb >= MAX_CLASSES:
        raise ValueError("corrupt delta: too many classes")
    bounds = [r.varint() for _ in range(nb)]
    if any(b >= (1 << exp_bits) for b in bounds) or bounds != sorted(bounds):
        raise ValueError("corrupt delta: bad class bounds")
    classes = _classes(old, bounds, mant)
    pos_parts, step_parts = [], []
    for c in range(nb + 1):
        ranks = positions(rice_decode(r))
        m = len(ranks)
        if not m:
            continue
        if ranks[-1] >= classes.count(c):
            raise ValueError("corrupt delta: change outside its class")
        pos_parts.append(classes.select(c, ranks))
        neg = np.unpackbits(np.frombuffer(r.take((m + 7) // 8), dtype=np.uint8), count=m).astype(bool)
        esc = positions(rice_decode(r))
        big = rice_decode(r)
        if len(big) != len(esc) or (len(esc) and esc[-1] >= m):
            raise ValueError("corrupt delta: bad step stream")
        mag = np.ones(m, dtype=np.int64)
        mag[esc] += big + 1
        step_parts.append(np.where(neg, -mag, mag))
    if r.pos != len(r.buf):
        raise ValueError("corrupt delta: trailing bytes")
    if not pos_parts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=old.dtype)
    pos = np.concatenate(pos_parts)
    step = np.concatenate(step_parts).astype(old.dtype)  # wraps modulo 2^bits, as encoded
    return pos, from_ordinal(to_ordinal(old[pos]) + step)


def encode_full(data: np.ndarray, level: int = 3) -> bytes:
    """zstd of the byte planes (all high bytes, then all low bytes...): exponents compress."""
    planes = np.ascontiguousarray(data.view(np.uint8).reshape(-1, data.itemsize).T)
    return zstandard.ZstdCompressor(level=level).compress(planes.tobytes())


def decode_full(payload: bytes | memoryview, itemsize: int, n: int) -> np.ndarray:
    try:
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=n * itemsize)
    except zstandard.ZstdError as e:
        raise ValueError(f"corrupt full copy: {e}") from None
    if len(raw) != n * itemsize:
        raise ValueError("corrupt full copy: wrong size")
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(itemsize, n)
    return np.ascontiguousarray(planes.T).view(f"<u{itemsize}").ravel()

