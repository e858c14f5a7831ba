"""In-place engine apply: live tensors become the new version exactly, between steps."""

import threading

import pytest
import torch

from strop.sync.apply import EngineSync, apply_inplace, bits_view, stage
from strop.sync.publisher import TrainerSync
from strop.sync.relay import Relay, http_link
from strop.sync.replica import prepare_patch
from strop.sync.store import Publisher, Store


def _model_versions(steps: int) -> list[dict[str, torch.Tensor]]:
    """bf16 snapshots of a small MLP whose fp32 weights drift by small random steps (an
    optimizer's first step costs seconds of lazy imports, and only the deltas matter here)."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    out = []
    with torch.no_grad():
        for _ in range(steps + 1):
            out.append({k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()})
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 3e-5)
    return out


def test_apply_inplace_is_exact_and_touches_only_changes(tmp_path):
    v = _model_versions(1)
    store = Store(str(tmp_path))
    pub = Publisher(store)
    for s in v:
        pub.publish({k: bits_view(t) for k, t in s.items()})
    live = {k: t.clone() for k, t in v[0].items()}
    ptrs = {k: t.data_ptr() for k, t in live.items()}
    state = {k: bits_view(t) for k, t in live.items()}
    patch, failed = prepare_patch(state, {k: t.crc32() for k, t in state.items()}, store.delta_bytes(1))
    assert not failed and patch.changes
    pause = apply_inplace(live, stage(patch, live))
    assert pause < 0.05
    for k in live:
        assert torch.equal(live[k].view(torch.int16), v[1][k].view(torch.int16)), k
        assert live[k].data_ptr() == ptrs[k]  # same storage: patched, not replaced


def test_engine_sync_widens_bf16_into_fp32_live_weights_and_repacks_only_changes(tmp_path):
    """An fp32 engine holding bf16 values (strop's CPU engine) follows a relay: its weights equal each
    version bit for bit, and the swap names only the tensors that changed."""
    v = _model_versions(3)
    v[2] = {**v[2], "2.bias": v[1]["2.bias"]}  # version 2 leaves one tensor as it was
    trainer = TrainerSync(str(tmp_path / "store"))
    trainer.publish(0, v[0])
    relay = Relay(trainer.origin_url).start()
    live = {k: t.float() for k, t in v[0].items()}
    swapped: list[list[str]] = []

    def swap(staged) -> float:  # what an engine does between two decode steps
        swapped.append(staged.names)
        return apply_inplace(live, staged)

    sync = EngineSync(live, version=-1, swap=swap)
    stop = threading.Event()
    follower = threading.Thread(
        target=sync.follow, args=(trainer.publisher.store, http_link(relay.url), trainer.origin_url, stop)
    )
    follower.start()
    try:
        assert sync.wait_version(0, 20)
        for version, state in enumerate(v[1:], start=1):
            trainer.publish(version, state)
            assert sync.wait_version(version, 20)
            for k in live:
                assert torch.equal(live[k], state[k].float()), (version, k)
    finally:
        stop.set()
        relay.close()
        trainer.close()
        follower.join(10)
    assert swapped[0] == []  # bootstrap: its own weights were version 0 already, nothing fetched
    assert "2.bias" not in swapped[2] and "2.weight" in swapped[2] and len(swapped[1]) == 4
    assert sync.reports[0].repaired == [] and max(sync.pauses) < 0.05
    assert trainer.stats()["deltas_sent"] == 3  # one relay: one copy of each delta left the trainer


def test_live_weights_that_are_not_bf16_are_refused():
    live = {"w": torch.tensor([1.0, 1.0 + 2**-20])}
    with pytest.raises(ValueError, match="not bf16"):
        EngineSync(live)


def test_staging_with_a_base_copies_dense_tensors_whole_and_scatters_sparse_ones():
    from strop.sync import codec

    old = {"dense": torch.randn(4096).bfloat16(), "sparse": torch.randn(4096).bfloat16()}
    new = {k: t.clone() for k, t in old.items()}
    new["dense"][::4] = (old["dense"][::4].float() * 1.02).bfloat16()  # a quarter changed: a delta, but dense
    new["sparse"][:10] += 1
    base = {k: bits_view(t.clone()) for k, t in old.items()}
    blob = codec.encode(base, {k: bits_view(t) for k, t in new.items()}, version=1, base_version=0)
    patch, failed = prepare_patch(base, {k: t.crc32() for k, t in base.items()}, blob)
    live = {k: t.float() for k, t in old.items()}
    staged = stage(patch, live, {k: "BF16" for k in live}, base)
    assert not failed and staged.cpu_puts["dense"][1] == slice(None) and len(staged.cpu_puts["sparse"][1]) == 10
    apply_inplace(live, staged)
    assert all(torch.equal(live[k], new[k].float()) and torch.equal(staged.values[k], new[k].float()) for k in new)


def test_a_dense_delta_is_staged_whole_and_a_sparse_one_as_changes():
    """A delta that changes more than 1/16 of a tensor arrives as the whole verified tensor, which
    the engine copies (a scatter of that many elements cost SmolLM2's update 2.7x the pause)."""
    import numpy as np

    from strop.sync import codec
    from strop.sync.synthetic import adamw_snapshots
    from strop.sync.tensors import Tensor

    n = codec.SMALL + 1  # coded alone: a group's members are always staged as changes
    dense, sparse = adamw_snapshots(n, 1e-5, keep=(0, 1)), adamw_snapshots(n, 1e-6, keep=(19, 20))  # 25%, 1% change
    base = {"dense": Tensor("BF16", (n,), dense[0]), "sparse": Tensor("BF16", (n,), sparse[19])}
    new = {"dense": Tensor("BF16", (n,), dense[1]), "sparse": Tensor("BF16", (n,), sparse[20])}
    blob = codec.encode(base, new, version=1, base_version=0)
    assert {e.method for e in codec.read_header(blob).entries} == {"delta"}
    live = {k: torch.from_numpy(t.data.view(np.int16).copy()).view(torch.bfloat16) for k, t in base.items()}
    state = {k: bits_view(t) for k, t in live.items()}
    patch, failed = prepare_patch(state, {k: t.crc32() for k, t in base.items()}, blob)
    assert not failed and set(patch.replace) == {"dense"} and set(patch.changes) == {"sparse"}
    apply_inplace(live, stage(patch, live))
    for k in new:
        assert np.array_equal(bits_view(live[k]).data, new[k].data), k
