"""Versions published in pieces (one per rank of a sharded trainer, `strop.sync.pieces`), here by
two piece publishers in one process: receivers assemble them bit-exactly, damage costs only the
tensors it touches, and the store rebuilds single tensors and folds its chain as for whole deltas."""

import os

import crc32c
import numpy as np
import pytest

from strop.sync import codec, pieces
from strop.sync.replica import Replica
from strop.sync.store import Publisher, Store
from strop.sync.tensors import Tensor, crc32_combine
from tests.test_sync_store import STEPS, _copy, assert_state, versions  # noqa: F401  (a fixture)

RANKS = 2


def split(state: dict[str, Tensor], rank: int) -> dict[str, Tensor]:
    """Rank `rank`'s pieces: each tensor's rows cut as FSDP cuts them ("frozen": rank 0's alone)."""
    out = {}
    for name, t in state.items():
        if name == "frozen":
            if rank == 0:
                out[pieces.piece_name(name, 0, len(t.data))] = t
            continue
        rows = t.shape[0]
        per = -(-rows // RANKS)
        row = len(t.data) // rows
        start, stop = min(rank * per, rows) * row, min((rank + 1) * per, rows) * row
        out[pieces.piece_name(name, start, stop)] = Tensor(t.dtype, (stop - start,), t.data[start:stop])
    return out


def publish_in_pieces(root: str, versions) -> Store:
    store = Store(root)
    pubs = [Publisher(store, piece=r) for r in range(RANKS)]
    for v, state in enumerate(versions):
        parts = []
        for r, pub in enumerate(pubs):
            mine = split(state, r)
            pub.publish(mine, v)
            parts.append(
                (
                    pub.nbytes,
                    {k: (t.dtype, state[pieces.parse(k)[0]].shape, pub.crcs[k], t.nbytes) for k, t in mine.items()},
                )
            )
        store.seal(v, None if v == 0 else v - 1, parts)
    return store


def test_crc_of_pieces_combines_to_the_whole():
    for la, lb in [(0, 5), (5, 0), (1, 1), (7, 13), (1000, 4097), (3, 1 << 20)]:
        a, b = os.urandom(la), os.urandom(lb)
        assert crc32_combine(crc32c.crc32c(a), crc32c.crc32c(b), lb) == crc32c.crc32c(a + b)


def test_pieces_assemble_bit_exact(tmp_path, versions):
    store = publish_in_pieces(str(tmp_path / "store"), versions)
    assert store.head() == {"latest": STEPS, "snapshot": 0}
    m = store.manifest(3)
    assert m.pieces == RANKS and m.tensors["a"][1:] == (versions[3]["a"].shape, versions[3]["a"].crc32())
    assert pieces.is_pieced(store.delta_bytes(3)) and len(pieces.split(store.delta_bytes(3))) == RANKS
    assert_state(Replica.bootstrap(store), versions[-1])
    for v in (0, 4):
        assert all(np.array_equal(store.state(v)[k].data, t.data) for k, t in versions[v].items())
    assert np.array_equal(store.tensor("b", 4).data, versions[4]["b"].data)  # rebuilt with its group-mates


def test_damaged_and_missing_pieces_cost_only_their_tensors(tmp_path, versions):
    store = publish_in_pieces(str(tmp_path / "store"), versions)
    r = Replica(_copy(versions[1]), 1)

    def piece(v: int, i: int) -> bytes:
        return store._read(store._delta_path(v, i))

    def damaged(v: int) -> bytes:
        if v == 2:
            return piece(2, 0)  # rank 1's piece lost on the way
        if v == 3:
            blob = bytearray(piece(3, 1))
            a = codec.read_header(blob).entry(pieces.piece_name("a", 75_000, 150_000))
            blob[codec.header_end(blob) + a.offset + a.length // 2] ^= 0x40
            return piece(3, 0) + bytes(blob)
        if v == 4:
            return (piece(4, 0) + piece(4, 1))[:-10]  # truncated: rank 1's last payload
        return store.delta_bytes(v)

    rep = r.advance(store, fetch=damaged)
    assert_state(r, versions[-1])
    assert rep.deltas == STEPS - 1
    # rank 1's pieces of a, b and c are coded as one group; "frozen" is rank 0's alone: never fetched
    assert rep.repaired == [f"v{v}:{k}" for v in (2, 3, 4) for k in "abc"]


def test_gc_folds_pieces_into_a_snapshot(tmp_path, versions):
    store = publish_in_pieces(str(tmp_path / "store"), versions)
    store.gc(4)
    assert store.head() == {"latest": STEPS, "snapshot": 4}
    assert sorted(p.rsplit("/", 1)[1] for p in store.fs.ls(store._path("snapshots"))) == ["00000004.safetensors"]
    assert sorted(p.rsplit("/", 1)[1] for p in store.fs.ls(store._path("deltas"))) == [
        f"0000000{v}.p{i}.delta" for v in (5, 6) for i in range(RANKS)
    ]
    assert_state(Replica.bootstrap(store), versions[-1])


def test_a_piece_gone_from_the_store_is_refused_clearly(tmp_path, versions):
    store = publish_in_pieces(str(tmp_path / "store"), versions)
    store.fs.rm(store._delta_path(3, 1))
    assert len(pieces.split(store.delta_bytes(3))) == 1  # what is left is still served
    with pytest.raises(codec.DeltaError):
        store.gc(4)
    with pytest.raises(Exception, match="cannot be rebuilt past version 2"):
        Replica(_copy(versions[2]), 2).advance(store)


class OneRank:
    """A rank group of one, for `TrainerSync.publish_shards` in this process."""

    rank = 0

    def gather(self, obj) -> list:
        return [obj]


def test_a_chain_gc_cannot_fold_is_cut_at_the_ranks_own_pieces(tmp_path):
    import torch

    from strop.sync.publisher import TrainerSync

    torch.manual_seed(0)
    w = torch.randn(64, 32)
    states = [(w * (1 + 0.01 * v)).to(torch.bfloat16) for v in range(3)]
    sync = TrainerSync(str(tmp_path / "store"), keep_deltas=1, ranks=OneRank())
    store = sync.publisher.store
    try:
        sync.publish_shards(0, {"w": ((64, 32), 0, states[0])})
        sync.publish_shards(1, {"w": ((64, 32), 0, states[1])})
        store.fs.rm(store._delta_path(1, 0))  # lost from the store: version 2 cannot be folded from it
        sync.publish_shards(2, {"w": ((64, 32), 0, states[2])})  # gc is due: the chain is cut at 2
        assert store.head() == {"latest": 2, "snapshot": 2}
        assert sorted(p.rsplit("/", 1)[1] for p in store.fs.ls(store._path("snapshots"))) == ["00000002.p0.safetensors"]
        want = states[2].view(torch.uint16).numpy().reshape(-1)
        assert np.array_equal(Replica.bootstrap(store).state["w"].data, want)
        straggler = Replica({"w": Tensor("BF16", (64, 32), states[0].view(torch.uint16).numpy().reshape(-1).copy())}, 0)
        rep = straggler.advance(store)
        assert np.array_equal(straggler.state["w"].data, want) and rep.repaired == ["v2:w"]
    finally:
        sync.close()
