"""The delta codec: bit-exact on every kind of change, and every kind of damage detected."""

import json
import struct

import numpy as np
import pytest
import zstandard

from strop.cli import main
from strop.sync import codec, tensors
from strop.sync import tensor_codec as tc
from strop.sync.bits import BitReader, mask_buffer, nonzero, rice_decode, rice_encode
from strop.sync.synthetic import adamw_snapshots
from strop.sync.tensors import Tensor

N = 200_000


@pytest.fixture(scope="module")
def snaps() -> dict[float, dict[int, np.ndarray]]:
    return {lr: adamw_snapshots(N, lr) for lr in (1e-6, 1e-5)}


def bf16(bits: np.ndarray, shape=None) -> Tensor:
    return Tensor("BF16", shape or (len(bits),), bits)


def roundtrip(base: dict, new: dict) -> bytes:
    blob = codec.encode(base, new, version=2, base_version=1)
    out = codec.decode(base, blob)
    assert sorted(out) == sorted(new)
    for k in new:
        assert out[k].dtype == new[k].dtype and out[k].shape == new[k].shape
        assert np.array_equal(out[k].data, new[k].data), k
    return blob


def test_rice_roundtrip():
    rng = np.random.default_rng(0)
    for v in (rng.geometric(0.01, 5000) - 1, np.zeros(7, dtype=np.int64), np.array([0, 1, 70000, 3])):
        assert np.array_equal(rice_decode(BitReader(rice_encode(v.copy()))), v)  # encode reuses its input


@pytest.mark.parametrize("density", [0.0, 0.01, 0.05, 0.099, 0.3, 1.0])
def test_nonzero_matches_numpy_at_every_density(density):
    # densities of 3-10% take the padded path; the pad must never leak into the result
    n = 100_003
    mask = np.random.default_rng(1).random(n) < density
    buf = mask_buffer(n)
    buf[:n] = mask
    assert np.array_equal(nonzero(buf, n), np.flatnonzero(mask))
    assert np.array_equal(nonzero(buf, n, int(mask.sum())), np.flatnonzero(mask))


@pytest.mark.parametrize("lr,old_step", [(1e-6, 19), (1e-6, 15), (1e-5, 19)])
def test_synthetic_rl_deltas_are_exact_and_small(snaps, lr, old_step):
    old, new = snaps[lr][old_step], snaps[lr][20]
    blob = roundtrip({"w": bf16(old)}, {"w": bf16(new)})
    assert codec.read_header(blob).entries[0].method == "delta"
    assert len(blob) < old.nbytes / 20


def test_every_bit_pattern_roundtrips():
    # NaNs, infs, -0 <-> +0, steps across the sign and wrapping the ordinal range
    rng = np.random.default_rng(2)
    old = rng.integers(0, 1 << 16, 50_000).astype(np.uint16)
    new = old.copy()
    hit = rng.choice(len(old), 2_000, replace=False)
    new[hit] = rng.integers(0, 1 << 16, len(hit))
    new[:4] = [0x0000, 0x8000, 0x7F80, 0xFFFF]
    old[:4] = [0x8000, 0x0000, 0x7FC1, 0x0000]
    roundtrip({"w": bf16(old)}, {"w": bf16(new)})


def test_fp32_f16_shape_dtype_and_set_changes(snaps):
    rng = np.random.default_rng(3)
    f32 = rng.normal(0, 0.02, 30_000).astype(np.float32)
    f32_sparse = f32.copy()
    f32_sparse[::50] = np.nextafter(f32_sparse[::50], np.float32(1))
    f16 = rng.normal(0, 1, 4_000).astype(np.float16)
    f16b = f16.copy()
    f16b[::7] += np.float16(0.01)
    old_bits = snaps[1e-6][19]
    base = {
        "dense32": Tensor("F32", (300, 100), f32.view(np.uint32)),
        "sparse32": Tensor("F32", (30_000,), f32.view(np.uint32)),
        "half": Tensor("F16", (4_000,), f16.view(np.uint16)),
        "reshaped": bf16(old_bits[:6000], (60, 100)),
        "retyped": bf16(old_bits[:6000]),
        "ints": Tensor("I64", (5,), np.arange(5, dtype=np.uint64)),
        "same": bf16(old_bits[:1000]),
        "dropped": bf16(old_bits[:10]),
    }
    new = {
        "dense32": Tensor("F32", (300, 100), (f32 * np.float32(1.001)).view(np.uint32)),
        "sparse32": Tensor("F32", (30_000,), f32_sparse.view(np.uint32)),
        "half": Tensor("F16", (4_000,), f16b.view(np.uint16)),
        "reshaped": bf16(old_bits[:6000], (100, 60)),
        "retyped": Tensor("F32", (6000,), (old_bits[:6000].astype(np.uint32) << 16)),
        "ints": Tensor("I64", (5,), np.arange(1, 6, dtype=np.uint64)),
        "same": bf16(old_bits[:1000]),
        "added": bf16(old_bits[:77]),
    }
    blob = roundtrip(base, new)
    methods = {e.name: e.method for e in codec.read_header(blob).entries}
    assert methods == {
        "dense32": "xor",
        "sparse32": "delta",
        "half": "delta",
        "reshaped": "full",
        "retyped": "full",
        "ints": "full",
        "same": "same",
        "added": "full",
    }


@pytest.fixture(scope="module")
def dense() -> dict[int, np.ndarray]:
    """AdamW at a pretraining learning rate: step 1 moves nearly every element, step 20 about 70%,
    by a few bf16 steps each."""
    return adamw_snapshots(N, 3e-4, keep=(0, 1, 19, 20))


@pytest.mark.parametrize("old_step,new_step", [(0, 1), (19, 20)])
def test_dense_small_step_change_goes_as_xor_and_round_trips(dense, old_step, new_step):
    old, new = dense[old_step], dense[new_step]
    assert np.count_nonzero(old != new) > 0.6 * N
    blob = roundtrip({"w": bf16(old)}, {"w": bf16(new)})
    assert codec.read_header(blob).entries[0].method == "xor"
    # smaller than the delta the encoder passed over, and than zstd of the plain XOR's bytes
    assert len(blob) < len(tc.encode_delta(old, new, "BF16"))
    assert len(blob) < len(zstandard.ZstdCompressor(level=3).compress((old ^ new).tobytes()))


def test_encoder_picks_delta_for_sparse_and_xor_for_dense(snaps, dense):
    base = {"sparse": bf16(snaps[1e-6][19]), "dense": bf16(dense[0])}
    new = {"sparse": bf16(snaps[1e-6][20]), "dense": bf16(dense[1])}
    blob = roundtrip(base, new)
    assert {e.name: e.method for e in codec.read_header(blob).entries} == {"sparse": "delta", "dense": "xor"}


def test_xor_wrong_base_and_corrupt_payload_are_caught(dense):
    base, new, other = ({"w": bf16(dense[s])} for s in (0, 1, 19))
    blob = codec.encode(base, new, version=1, base_version=0)
    e = codec.read_header(blob).entry("w")
    assert e.method == "xor"
    with pytest.raises(codec.DeltaError, match="wrong base") as err:
        codec.decode(other, blob)
    assert err.value.tensors == ["w"]
    with pytest.raises(codec.DeltaError, match="fails its checksum"):
        codec.decode(other, blob, check_base=False)  # the result crc catches it
    bad = bytearray(blob)
    bad[codec.header_end(blob) + e.offset + e.length // 2] ^= 0x04
    with pytest.raises(codec.DeltaError, match="'w'.*corrupt") as err:
        codec.decode(base, bytes(bad))
    assert err.value.tensors == ["w"]


def _with_header(blob: bytes, **changes) -> bytes:
    """`blob` with fields of its header changed (and the header's crc made right again)."""
    end = codec.header_end(blob)
    head = json.loads(zstandard.ZstdDecompressor().decompress(blob[codec.PREFIX_SIZE : end]))
    head.update(changes)
    hb = zstandard.ZstdCompressor().compress(json.dumps(head).encode())
    return struct.pack("<8sII", codec.MAGIC, len(hb), tensors.crc32(hb)) + hb + blob[end:]


def test_format_3_is_read_and_others_refused(snaps):
    base, new = {"w": bf16(snaps[1e-6][19])}, {"w": bf16(snaps[1e-6][20])}
    blob = codec.encode(base, new, version=1, base_version=0)
    # format 3 is format 4 without `xor`: a delta written before it still applies
    assert np.array_equal(codec.decode(base, _with_header(blob, format=3))["w"].data, new["w"].data)
    with pytest.raises(codec.DeltaError, match="format 2 is not supported"):
        codec.decode(base, _with_header(blob, format=2))
    e = codec.read_header(blob).entries[0]
    row = [e.name, "zigzag", e.dtype, list(e.shape), e.offset, e.length, e.payload_crc32, e.base_crc32, e.crc32, None]
    with pytest.raises(codec.DeltaError, match="unknown method") as err:
        codec.read_header(_with_header(blob, tensors=[row]))
    assert err.value.tensors == ["w"]


@pytest.fixture()
def pair(snaps):
    a, b, c = (snaps[1e-6][s] for s in (15, 19, 20))
    base = {"x": bf16(b), "y": bf16(b[::-1].copy())}
    new = {"x": bf16(c), "y": bf16(c[::-1].copy())}
    other = {"x": bf16(a), "y": bf16(b[::-1].copy())}
    return base, new, other, codec.encode(base, new, version=20, base_version=19)


def test_corrupt_byte_names_the_tensor(pair):
    base, new, _, blob = pair
    h = codec.read_header(blob)
    e = h.entry("y")
    bad = bytearray(blob)
    bad[len(blob) - h.payload_bytes + e.offset + e.length // 2] ^= 0x10
    with pytest.raises(codec.DeltaError, match="'y'.*corrupt") as err:
        codec.decode(base, bytes(bad))
    assert err.value.tensors == ["y"]


def test_corrupt_header_and_truncation(pair):
    base, _, _, blob = pair
    bad = bytearray(blob)
    bad[20] ^= 1
    with pytest.raises(codec.DeltaError, match="header is corrupt"):
        codec.decode(base, bytes(bad))
    with pytest.raises(codec.DeltaError, match="truncated") as err:
        codec.decode(base, blob[:-10])
    assert err.value.tensors == ["y"]  # tensors are in name order; x is still whole
    with pytest.raises(codec.DeltaError, match="truncated"):
        codec.decode(base, blob[:10])


def test_wrong_base_is_refused(pair):
    _, _, other, blob = pair
    with pytest.raises(codec.DeltaError, match="wrong base") as err:
        codec.decode(other, blob)
    assert err.value.tensors == ["x"]
    # even without the base check, the payload's structure or the result checksum catches it
    with pytest.raises(codec.DeltaError, match="wrong base"):
        codec.decode(other, blob, check_base=False)


def test_safetensors_interop(tmp_path, snaps):
    import torch
    from safetensors.torch import load_file, save_file

    t = torch.randn(3, 5).to(torch.bfloat16)
    save_file({"t": t, "i": torch.arange(4)}, tmp_path / "a.safetensors")
    ours = tensors.load(str(tmp_path / "a.safetensors"))
    assert ours["t"].dtype == "BF16" and ours["t"].shape == (3, 5)
    assert np.array_equal(ours["t"].data, t.view(torch.int16).numpy().view(np.uint16).ravel())
    tensors.save(ours, str(tmp_path / "b.safetensors"))
    back = load_file(tmp_path / "b.safetensors")
    assert torch.equal(back["t"], t) and torch.equal(back["i"], torch.arange(4))


def test_cli_roundtrip_and_errors(tmp_path, snaps, capsys):
    s = snaps[1e-6]
    old, new, wrong = tmp_path / "old.st", tmp_path / "new.st", tmp_path / "wrong.st"
    tensors.save({"w": bf16(s[19], (400, 500))}, str(old))
    tensors.save({"w": bf16(s[20], (400, 500))}, str(new))
    tensors.save({"w": bf16(s[15], (400, 500))}, str(wrong))
    delta, out = tmp_path / "d.delta", tmp_path / "out.st"
    assert main(["sync", "encode", "--base", str(old), "--new", str(new), "-o", str(delta)]) == 0
    assert main(["sync", "decode", "--base", str(old), str(delta), "-o", str(out)]) == 0
    assert out.read_bytes() == new.read_bytes()
    assert main(["sync", "decode", "--base", str(wrong), str(delta), "-o", str(out)]) == 2
    assert "wrong base" in capsys.readouterr().err
    bad = bytearray(delta.read_bytes())
    bad[-100] ^= 0xFF
    delta.write_bytes(bytes(bad))
    assert main(["sync", "decode", "--base", str(old), str(delta), "-o", str(out)]) == 2
    assert "corrupt" in capsys.readouterr().err
    assert main(["sync", "decode", "--base", str(tmp_path / "nope"), str(delta), "-o", str(out)]) == 2
    assert "no such file" in capsys.readouterr().err


def test_small_tensors_share_a_group_payload_and_damage_names_its_members(snaps):
    s = snaps[1e-5]
    base = {f"t{i}": bf16(s[19][i * 5000 : (i + 1) * 5000]) for i in range(4)}
    new = {f"t{i}": bf16(s[20][i * 5000 : (i + 1) * 5000]) for i in range(4)}
    blob = roundtrip(base, new)
    h = codec.read_header(blob)
    assert [[e.name for e in u] for u in h.units()] == [["t0", "t1", "t2", "t3"]]
    assert [e.part for e in h.entries] == [0, 5000, 10000, 15000]
    bad = bytearray(blob)
    bad[-3] ^= 0x01
    with pytest.raises(codec.DeltaError, match="group payload is corrupt") as err:
        codec.decode(base, bytes(bad))
    assert err.value.tensors == ["t0", "t1", "t2", "t3"]
    wrong = dict(base, t2=bf16(s[15][10000:15000]))
    with pytest.raises(codec.DeltaError, match="wrong base") as err:
        codec.decode(wrong, blob)
    assert err.value.tensors == ["t0", "t1", "t2", "t3"]
    with pytest.raises(codec.DeltaError, match="wrong base") as err:
        codec.decode(wrong, blob, check_base=False)  # the members' result crcs catch it
    assert "t2" in err.value.tensors


def test_bench_sync_on_equal_snapshots_says_so(tmp_path):
    """The reproduction: an RL stage whose weights did not change left two equal snapshots, and
    `strop bench sync` crashed dividing by the empty index-value delta. Now the newest differing
    pair is measured, and a directory of equal ones is a one-line error before any work."""
    import subprocess
    import sys

    from strop.bench.sync import _load_demo_run

    rng = np.random.default_rng(0)
    w = rng.integers(0, 1 << 15, 1000, dtype=np.uint16)
    for v, data in ((1, w ^ 1), (2, w), (3, w)):  # v2 -> v3 changed nothing
        tensors.save({"w": tensors.Tensor("BF16", (1000,), data)}, str(tmp_path / f"v{v:06d}.safetensors"))
    (old, new), info = _load_demo_run(str(tmp_path))
    assert "v000001" in info["source"] and not np.array_equal(old["w"].data, new["w"].data)
    (tmp_path / "v000001.safetensors").unlink()
    assert _load_demo_run(str(tmp_path)) is None
    out = subprocess.run(
        [sys.executable, "-m", "strop.cli", "bench", "sync", "--quick", "--no-fanout", "--demo-run", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "all equal" in out.stderr and "Traceback" not in out.stderr, out.stderr
