"""A policy loaded straight into its shards (`strop.train.shard_load`) on two real gloo ranks holds
exactly the saved weights: each rank reads only its rows (fused experts from the per-expert
tensors on disk), buffers come out as a whole build makes them, the head stays tied."""

import torch

from strop.model.meta import parameters_on_meta
from strop.model.policy import load_model
from strop.train.parallel import Ranks, local, start_ranks, stop_ranks, whole
from strop.train.shard_load import load_sharded_model, rows_of


def gathered(ranks, path: str) -> tuple[dict, dict, int, bool]:
    """Every rank: load its shards; the whole parameters, the buffers, how many elements this rank
    holds, and whether the head is the embedding's parameter."""
    model = load_sharded_model(path, ranks)
    params = {
        name: whole(p).detach().clone() for name, p in model.named_parameters()
    }  # a collective, same order on every rank
    held = sum(local(p).numel() for p in model.parameters())
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return params, dict(model.named_buffers()), held, tied


def test_two_ranks_load_their_shards_of_the_saved_policy(tiny_policy_dir):
    ranks, procs = start_ranks(2, gathered, (str(tiny_policy_dir),))
    try:
        params, buffers, held, tied = gathered(ranks, str(tiny_policy_dir))
    finally:
        stop_ranks(procs)
    full = load_model(tiny_policy_dir)
    expected = dict(full.named_parameters())
    assert params.keys() == expected.keys() and tied
    for name, t in params.items():
        assert torch.equal(t, expected[name]), name
    for name, b in full.named_buffers():
        assert torch.equal(buffers[name], b), name
    total = sum(p.numel() for p in full.parameters())
    assert total / 2 - 64 <= held <= total / 2 + 64  # rank 0 holds its half (dim-0 chunks)


def test_meta_parameters_and_real_buffers():
    with parameters_on_meta():
        layer = torch.nn.Linear(4, 3)
        layer.register_buffer("scale", torch.arange(3.0))
    assert layer.weight.is_meta and layer.bias.is_meta and not layer.scale.is_meta
    assert torch.equal(layer.scale, torch.arange(3.0))
    assert torch.nn.Linear(2, 2).weight.is_meta is False  # the patch ends with the block


def test_rows_follow_fsdp_chunks():
    assert [rows_of(10, Ranks(r, 4, mesh=object())) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [rows_of(2, Ranks(r, 4, mesh=object())) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
