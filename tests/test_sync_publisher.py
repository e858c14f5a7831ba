"""The in-process publisher ships deltas and hands engines bit-exact weights."""

import torch

from strop.sync.publisher import DeltaPublisher


def test_published_deltas_reconstruct_the_snapshot_and_are_small(tmp_path):
    torch.manual_seed(0)
    master = {"w": torch.randn(512, 256) * 0.02, "b": torch.randn(256) * 0.02}
    pub = DeltaPublisher()
    first, full = pub.publish(0, {k: v.bfloat16() for k, v in master.items()})
    assert full == sum(v.numel() * 2 for v in master.values())
    for version in (1, 2):
        master["w"] += 1e-5 * torch.randn_like(master["w"])  # an RL-sized step: few bf16 values move
        state = {k: v.bfloat16() for k, v in master.items()}
        received, nbytes = pub.publish(version, state)
        assert all(torch.equal(received[k].view(torch.int16), state[k].view(torch.int16)) for k in state)
        assert received["w"].dtype == torch.bfloat16 and received["w"].shape == (512, 256)
        assert nbytes < full / 4
    # the last two versions go to disk as snapshots the sync benchmark can read
    paths = pub.save_last(tmp_path / "snapshots")
    assert [p.name for p in paths] == ["00000001.safetensors", "00000002.safetensors"]
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(paths[-1]))["w"].view(torch.int16), state["w"].view(torch.int16))
