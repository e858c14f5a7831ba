"""Router capture and replay (R3) on the trainer side."""

import pytest
import torch

from strop.engine.engine import Engine
from strop.model.mismatch import mismatch_metrics, recompute
from strop.model.routing import capture_routing, moe_blocks, replay_routing, stack_routing
from strop.policy_api import SamplingParams


@pytest.fixture(params=["qwen3_moe", "deepseek_v3"])
def moe(request, tiny_tokenizer):
    from strop.model.policy import build_model
    from tests.conftest import tiny_model_section

    return build_model(tiny_model_section(request.param), tiny_tokenizer, seed=0).eval()


def test_replay_makes_trainer_route_as_engine(moe, tiny_tokenizer):
    eng = Engine(moe, tiny_tokenizer, max_batch=4, max_len=128)
    prompts = [tiny_tokenizer.encode(t) for t in ("def f(x):", "import sys\nimport os", "y = 2")]
    outs = eng.generate(prompts, SamplingParams(max_tokens=16, seed=3, stop_token_ids=[]))
    for o in outs:
        lp, routing = recompute(moe, o.prompt_ids, o.token_ids, routing=o.routing)
        assert (routing.numpy() == o.routing).all()  # zero routing disagreements by construction
        m = mismatch_metrics(o.logprobs, lp, engine_routing=o.routing, trainer_routing=routing)
        assert m["routing_flip_rate"] == 0.0 and m["max_abs_dlogp"] < 1e-4


def test_replay_gates_still_learn_and_capture_matches(moe):
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), capture_routing(moe) as rec:
        ref = moe(ids).logits
    n_exp = moe_blocks(moe)[0].gate.num_experts
    routing = stack_routing(rec, (2, 12), n_exp)
    assert routing.shape == (2, 12, 2, moe.config.num_experts_per_tok)
    with replay_routing(moe, routing):
        out = moe(ids).logits
    assert torch.allclose(out, ref, atol=1e-5)  # the model's own routing replayed: the same function
    out.float().logsumexp(-1).mean().backward()
    assert all(b.gate.weight.grad is not None and b.gate.weight.grad.abs().sum() > 0 for b in moe_blocks(moe))
    moe.zero_grad()
    flipped = routing.clone()
    flipped[..., 0, :] = torch.arange(moe.config.num_experts_per_tok).to(routing.dtype)  # force experts 0..k-1
    with torch.no_grad(), replay_routing(moe, flipped), capture_routing(moe) as rec2:
        moe(ids)
    assert (stack_routing(rec2, (2, 12), n_exp) == flipped).all()


def test_partial_replay_takes_the_routers_own_choice_in_the_same_forward(moe):
    """Unrecorded positions (ids < 0) route by the router's own top-k at this forward's hidden
    states: nothing recorded is the plain forward, and positions before the first recorded one are
    untouched by replay (attention is causal; equal up to the experts' grouping of tokens)."""
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(1))
    n_exp, k = moe_blocks(moe)[0].gate.num_experts, moe.config.num_experts_per_tok
    with torch.no_grad(), capture_routing(moe) as rec:
        ref = moe(ids).logits
    own = stack_routing(rec, (2, 12), n_exp).long()
    nothing = torch.full_like(own, -1)
    with torch.no_grad(), replay_routing(moe, nothing):
        assert torch.equal(moe(ids).logits, ref)
    partial = nothing.clone()
    partial[:, 6:] = torch.arange(k)  # positions 6.. forced through experts 0..k-1
    with torch.no_grad(), replay_routing(moe, partial), capture_routing(moe) as rec2:
        out = moe(ids).logits
    used = stack_routing(rec2, (2, 12), n_exp).long()
    assert (used[:, 6:] == torch.arange(k)).all() and torch.equal(used[:, :6], own[:, :6])
    assert torch.allclose(out[:, :6], ref[:, :6], atol=1e-5) and not torch.allclose(out[:, 6:], ref[:, 6:])


def test_replay_consumed_exactly_once(moe):
    ids = torch.randint(0, 500, (1, 6))
    with torch.no_grad(), capture_routing(moe) as rec:
        moe(ids)
    routing = stack_routing(rec, (1, 6), moe_blocks(moe)[0].gate.num_experts)
    with pytest.raises(AssertionError, match="consumed twice"), torch.no_grad(), replay_routing(moe, routing):
        moe(ids)
        moe(ids)
    with pytest.raises(AssertionError, match="exactly once"), replay_routing(moe, routing):
        pass
    with pytest.raises(AssertionError, match="recorded tokens"), torch.no_grad(), replay_routing(moe, routing):
        moe(torch.randint(0, 500, (1, 7)))


def test_mismatch_metrics_values():
    e = torch.log(torch.tensor([0.5, 0.25, 0.1, 0.2]))
    t = torch.log(torch.tensor([0.5, 0.45, 0.01, 0.2]))
    m = mismatch_metrics(e, t, mask=torch.tensor([1, 1, 1, 0]))
    assert m["tokens"] == 3 and m["bitwise_equal_frac"] == pytest.approx(1 / 3)
    assert m["ratio_outside_frac"] == pytest.approx(1 / 3) and m["max_abs_dlogp"] == pytest.approx(2.302585, rel=1e-5)
    assert m["k3"] > 0
