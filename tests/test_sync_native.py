"""The delta coder's C path: the very bytes of the numpy reference on every kind of change,
decodes that match it, and damaged payloads refused with a ValueError, never a crash."""

import contextlib

import numpy as np
import pytest

from strop.sync import native_coder
from strop.sync import tensor_codec as tc
from strop.sync.synthetic import adamw_snapshots

pytestmark = pytest.mark.skipif(not native_coder.available(), reason="no C compiler here")

BITS = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32}


@contextlib.contextmanager
def numpy_path():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native_coder, "available", lambda: False)
        yield


def weights(rng: np.random.Generator, n: int, dtype: str) -> np.ndarray:
    """Bit patterns of normal weights: small ones change more often, as in RL steps, so the
    class split (rank-coded low class) is exercised."""
    w = (rng.standard_normal(n) * 0.02).astype(np.float32)
    if dtype == "BF16":
        return (w.view(np.uint32) >> 16).astype(np.uint16)
    return w.astype(np.float16).view(np.uint16) if dtype == "F16" else w.view(np.uint32)


def changed(rng: np.random.Generator, old: np.ndarray, density: float, extreme: bool) -> np.ndarray:
    """old with about `density` of it changed: mostly ±1 ulp with some bigger steps, or (extreme)
    any bit pattern at all, NaN, inf, ±0 and steps of half the ordinal range included."""
    bits = old.itemsize * 8
    absw = (old & ((1 << (bits - 1)) - 1)).astype(np.float64)
    p = density * 2 * (absw < np.median(absw))  # the lower half of the magnitudes changes
    at = np.flatnonzero(rng.random(len(old)) < p)
    new = old.copy()
    if extreme:
        special = np.array(
            [
                0,
                1 << (bits - 1),
                (1 << bits) - 1,
                0x7F80 if bits == 16 else 0x7F800000,
                0x7FC0 if bits == 16 else 0x7FC00000,
                1 << (bits - 2),
            ],
            dtype=np.uint64,
        )
        pick = rng.random(len(at)) < 0.5
        vals = np.where(pick, rng.choice(special, len(at)), rng.integers(0, 1 << bits, len(at), dtype=np.uint64))
        new[at] = vals.astype(old.dtype)
    else:
        step = np.where(rng.random(len(at)) < 0.8, 1, rng.integers(2, 300, len(at))) * rng.choice([-1, 1], len(at))
        key = tc.order_key(old[at].copy()).astype(np.int64) + step
        new[at] = tc.order_key((key % (1 << bits)).astype(old.dtype))
    return new


def both_paths(old: np.ndarray, new: np.ndarray, dtype: str) -> bytes:
    """Encode and decode with C and with numpy: same bytes, same changes, and the new tensor back."""
    payload = tc.encode_delta(old, new, dtype)
    with numpy_path():
        assert tc.encode_delta(old, new, dtype) == payload
        pos_np, vals_np = tc.decode_delta(old, payload, dtype)
        assert np.array_equal(tc.apply_delta(old, payload, dtype), new)
    pos, vals = tc.decode_delta(old, payload, dtype)
    assert np.array_equal(pos, pos_np) and np.array_equal(vals, vals_np) and vals.dtype == old.dtype
    assert np.array_equal(tc.apply_delta(old, payload, dtype), new)
    inplace = old.copy()
    tc.apply_delta(inplace, payload, dtype, out=inplace)
    assert np.array_equal(inplace, new)
    return payload


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("density", [0.001, 0.05, 0.2, 0.39])
@pytest.mark.parametrize("extreme", [False, True])
def test_same_bytes_as_numpy(dtype, density, extreme):
    rng = np.random.default_rng(int(density * 1000) + 7 * extreme)
    for n in (1, 63, 64, 65, 130, 4099, 200_003):  # whole and partial 64-element blocks
        old = weights(rng, n, dtype)
        new = changed(rng, old, density, extreme)
        if np.array_equal(old, new):
            new[rng.integers(n)] ^= 1
        both_paths(old, new, dtype)


def test_real_rl_steps_use_both_classes():
    snaps = adamw_snapshots(300_000, 1e-5, keep=(15, 19, 20))
    for a in (15, 19):
        payload = both_paths(snaps[a], snaps[20], "BF16")
        assert payload[0] == 1  # a low class coded by rank


def test_count_changes_and_non_contiguous_arrays():
    rng = np.random.default_rng(3)
    old = weights(rng, 10_001, "F32")
    new = changed(rng, old, 0.2, False)
    assert tc.count_changes(old, new)[1] == np.count_nonzero(old != new)
    strided_old, strided_new = old[::2], new[::2]  # the C coder reads flat buffers: numpy takes these
    payload = tc.encode_delta(strided_old, strided_new, "F32")
    assert np.array_equal(tc.apply_delta(strided_old, payload, "F32"), strided_new)


def test_damaged_payloads_raise_and_never_write_out_of_range():
    rng = np.random.default_rng(5)
    snaps = adamw_snapshots(20_000, 1e-5, keep=(19, 20))
    old, new = snaps[19], snaps[20]
    payload = tc.encode_delta(old, new, "BF16")
    damaged = [payload[:cut] for cut in range(0, len(payload), max(1, len(payload) // 300))]
    for _ in range(400):
        b = bytearray(payload)
        for at in rng.integers(0, len(b), rng.integers(1, 4)):
            b[at] = int(rng.integers(256))
        damaged.append(bytes(b))
    damaged += [payload + b"\x00", b"\x02", b"\x01\xff\x01", bytes(rng.integers(0, 256, 64, dtype=np.uint8))]
    for bad in damaged:
        try:
            pos, vals = tc.decode_delta(old, bad, "BF16")
        except ValueError:
            continue
        assert len(pos) == len(vals) and (len(pos) == 0 or (pos.min() >= 0 and pos.max() < len(old)))
