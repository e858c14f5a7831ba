"""The trainer's end of the transport: each version is encoded in the trainer's process, written to
the store, and served by the origin; what leaves it for a version after the first is the delta, and
a tensor the store can no longer rebuild is still served from the trainer's own copy."""

import torch

from strop.sync import codec
from strop.sync.publisher import TrainerSync
from strop.sync.relay import get, tensor_fetcher
from strop.sync.replica import Replica


def _versions(n: int) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    master = {"w": torch.randn(512, 256) * 0.02, "b": torch.randn(256) * 0.02}
    out = []
    for _ in range(n):
        out.append({k: v.bfloat16() for k, v in master.items()})
        master["w"] += 1e-5 * torch.randn_like(master["w"])  # an RL-sized step: few bf16 values move
    return out


def test_published_versions_are_deltas_on_the_wire_and_rebuild_bit_exact(tmp_path):
    states = _versions(3)
    full_bytes = sum(v.numel() * 2 for v in states[0].values())
    sync = TrainerSync(str(tmp_path / "store"))
    try:
        for version, state in enumerate(states):
            sync.publish(version, state)
        store = sync.publisher.store
        assert store.head() == {"latest": 2, "snapshot": 0}
        blobs = [get(f"{sync.origin_url}/delta/{v}") for v in (1, 2)]
        assert [len(b) for b in blobs] == [store.manifest(v).nbytes for v in (1, 2)]
        assert all(len(b) < full_bytes / 4 for b in blobs)
        assert sync.stats()["sent_by_version"] == {1: [1, len(blobs[0])], 2: [1, len(blobs[1])]}
        r = Replica.bootstrap(store)
        assert all(
            torch.equal(torch.from_numpy(r.state[k].data.view("int16")).view(torch.bfloat16).view(t.shape), t)
            for k, t in states[-1].items()
        )
    finally:
        sync.close()


def test_full_mode_ships_every_tensor_whole_in_the_same_format(tmp_path):
    states = _versions(2)
    sync = TrainerSync(str(tmp_path / "store"), full=True)
    try:
        sync.publish(0, states[0])
        sync.publish(1, states[1])
        h = codec.read_header(sync.publisher.store.delta_bytes(1))
        assert {e.method for e in h.entries} == {"full"}
        assert sync.publisher.store.state(1)["w"].crc32() == sync.publisher.crcs["w"]
    finally:
        sync.close()


def test_a_tensor_lost_from_the_store_is_served_from_the_trainers_copy(tmp_path):
    states = _versions(3)
    sync = TrainerSync(str(tmp_path / "store"))
    try:
        for version, state in enumerate(states):
            sync.publish(version, state)
        store = sync.publisher.store
        store.fs.rm(store._delta_path(1))  # the chain is cut: version 2 cannot be rebuilt from the store
        tensor = tensor_fetcher(sync.origin_url)
        assert tensor("w", 2).crc32() == store.manifest(2).tensors["w"][2]
        sync.publish(3, states[0])  # folding now fails too: the snapshot moves to the trainer's copy
        sync.publisher.gc(1)
        assert store.head() == {"latest": 3, "snapshot": 3}
    finally:
        sync.close()
