"""The snapshot/delta store and a replica walking the chain: damage is repaired per tensor."""

import uuid

import numpy as np
import pytest

from strop.sync import codec
from strop.sync.replica import Replica
from strop.sync.store import MissingPiece, Publisher, Store
from strop.sync.synthetic import adamw_snapshots
from strop.sync.tensors import Tensor

N = 150_000  # "a" is above codec.SMALL (coded alone); "b" and "c" are coded as one group
STEPS = 6


@pytest.fixture(scope="module")
def versions() -> list[dict[str, Tensor]]:
    """STEPS+1 versions of a 4-tensor model; tensor "frozen" never changes after v0."""
    a = adamw_snapshots(N, 1e-5, steps=STEPS, keep=tuple(range(STEPS + 1)), seed=1)
    b = adamw_snapshots(N // 3, 1e-5, steps=STEPS, keep=tuple(range(STEPS + 1)), seed=2)
    c = adamw_snapshots(N // 10, 1e-5, steps=STEPS, keep=tuple(range(STEPS + 1)), seed=4)
    frozen = adamw_snapshots(1000, 1e-5, steps=0, keep=(0,), seed=3)[0]
    return [
        {
            "a": Tensor("BF16", (N // 100, 100), a[v]),
            "b": Tensor("BF16", (N // 3,), b[v]),
            "c": Tensor("BF16", (N // 10,), c[v]),
            "frozen": Tensor("BF16", (1000,), frozen),
        }
        for v in range(STEPS + 1)
    ]


def publish_all(root: str, versions) -> Store:
    store = Store(root)
    pub = Publisher(store)
    for state in versions:
        pub.publish(state)
    return store


def assert_state(replica: Replica, state: dict[str, Tensor]) -> None:
    assert sorted(replica.state) == sorted(state)
    for k, t in state.items():
        assert replica.state[k].shape == t.shape and np.array_equal(replica.state[k].data, t.data), k


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "store")
    return f"memory://strop-test-{uuid.uuid4().hex}"  # fresh; no glob characters in the path


def test_chain_reaches_latest_bit_exact(root, versions):
    store = publish_all(root, versions)
    assert store.head() == {"latest": STEPS, "snapshot": 0}
    r = Replica.bootstrap(store)
    assert r.version == STEPS
    assert_state(r, versions[-1])
    m = store.manifest(3)
    assert m.base_version == 2 and m.tensors["frozen"][2] == m.tensors["frozen"][2]


def test_versions_saved_whole_as_safetensors(tmp_path, versions):
    from strop.sync.tensors import load

    store = publish_all(str(tmp_path / "store"), versions)
    paths = store.save_versions([2, 3], tmp_path / "snapshots")
    assert [p.name for p in paths] == ["00000002.safetensors", "00000003.safetensors"]
    for path, v in zip(paths, (2, 3)):
        saved = load(str(path))
        assert sorted(saved) == sorted(versions[v])
        assert all(saved[k].shape == t.shape and np.array_equal(saved[k].data, t.data) for k, t in versions[v].items())


def test_single_tensor_served_at_full_precision(root, versions):
    store = publish_all(root, versions)
    assert np.array_equal(store.tensor("b", 4).data, versions[4]["b"].data)  # rebuilt with its group-mate
    assert np.array_equal(store.tensor("a", 4).data, versions[4]["a"].data)
    h = codec.read_header(store.delta_bytes(4))
    assert [[e.name for e in u] for u in h.units()] == [["a"], ["b", "c"], ["frozen"]]


def test_corrupt_and_truncated_deltas_repaired_per_tensor(root, versions):
    store = publish_all(root, versions)
    r = Replica(_copy(versions[1]), 1)

    def damaged(v: int) -> bytes:
        blob = bytearray(store.delta_bytes(v))
        if v == 2:
            blob[-5] ^= 0x40  # lands in the last payload ("frozen" is `same`: the group of b and c)
        if v == 3:
            a = codec.read_header(blob).entry("a")
            blob[codec.header_end(blob) + a.offset + a.length // 2] ^= 0x40
        if v == 4:
            del blob[-10:]
        return bytes(blob)

    rep = r.advance(store, fetch=damaged)
    assert_state(r, versions[-1])
    # only the damaged tensor, or the members of a damaged group — never the whole model
    assert rep.repaired == ["v2:b", "v2:c", "v3:a", "v4:b", "v4:c"]


def test_missing_link_fetches_only_changed_tensors(root, versions):
    store = publish_all(root, versions)
    r = Replica(_copy(versions[2]), 2)

    def lossy(v: int) -> bytes:
        if v == 3:
            raise MissingPiece("relay lost it")
        return store.delta_bytes(v)

    rep = r.advance(store, fetch=lossy)
    assert_state(r, versions[-1])
    assert rep.repaired == ["v3:a", "v3:b", "v3:c"]  # "frozen" did not change in v3: not fetched


def test_wrong_base_replica_repairs_tensors(root, versions):
    store = publish_all(root, versions)
    state = _copy(versions[2])
    r = Replica(state, 3)  # claims v3 but holds v2 — its checksums say so
    r.crcs = {k: t.crc32() for k, t in state.items()}
    r.advance(store)
    assert_state(r, versions[-1])


def test_gc_folds_old_deltas_and_stragglers_jump(root, versions):
    store = publish_all(root, versions)
    store.gc(4)
    assert store.head() == {"latest": STEPS, "snapshot": 4}
    with pytest.raises(MissingPiece):
        store.delta_bytes(3)
    with pytest.raises(MissingPiece):
        store.manifest(3)
    assert_state(Replica.bootstrap(store), versions[-1])
    straggler = Replica(_copy(versions[1]), 1)
    rep = straggler.advance(store)
    assert_state(straggler, versions[-1])
    assert sorted(rep.repaired) == ["v4:a", "v4:b", "v4:c"]  # "frozen" matched: not fetched


def test_unrecoverable_gap_is_refused_clearly(root, versions):
    store = publish_all(root, versions)
    store.fs.rm(store._delta_path(3))
    r = Replica(_copy(versions[2]), 2)
    with pytest.raises(MissingPiece, match="'a' cannot be rebuilt past version 2"):
        r.advance(store)


def _copy(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: Tensor(t.dtype, t.shape, t.data.copy()) for k, t in state.items()}
