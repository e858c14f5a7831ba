"""Deterministic mode: engine logprobs and routing equal the trainer's bit for bit, whatever the batch
composition, slot, neighbours, prefill vs decode, prefix reuse or request order; the trainer's
forward on the same kernels still trains.

`test_ci_gate_engine_and_trainer_agree_bitwise` is the CI gate (as slime gates on train-rollout
logprob differences): multi-turn traffic with prefix reuse through the engine, the trainer's own
code path (`build_batch`, `token_logprobs`, `router_replay`), and not one token or routing decision
may differ."""

import random
from contextlib import ExitStack

import pytest
import torch

from strop import kernels
from strop.engine.engine import Engine
from strop.env.episode import Segment
from strop.model import deterministic as det
from strop.model import kernel_ops
from strop.model.mismatch import recompute, routing_flip_rate
from strop.model.routing import capture_routing, moe_blocks, stack_routing
from strop.policy_api import SamplingParams, generated_routing
from strop.rl.orchestrator import router_replay
from strop.rl.trainer import build_batch, token_logprobs

pytestmark = pytest.mark.skipif(not kernels.available(), reason="deterministic mode needs the C kernels")

TEXTS = ["def f(x):\n    return x", "import os", "class A:\n", "x = [1, 2, 3]\nprint(x)", "while True:", "# note " * 40]


def _run(engine: Engine, rounds: list[list[list[int]]], rng: random.Random | None) -> list:
    """Generate for each round of prompts in turn (a later round can reuse an earlier one's KV),
    each round submitted in a shuffled order when rng is given; outputs in prompt order."""
    outs, seed = [], 0
    for prompts in rounds:
        params = [
            SamplingParams(max_tokens=6 + 3 * (seed + i), seed=seed + i, stop_token_ids=[]) for i in range(len(prompts))
        ]
        order = list(range(len(prompts)))
        if rng is not None:
            rng.shuffle(order)
        got = engine.generate([prompts[i] for i in order], [params[i] for i in order])
        outs += [o for _, o in sorted(zip(order, got), key=lambda pair: pair[0])]
        seed += len(prompts)
    return outs


def test_engine_rows_do_not_depend_on_their_batch(tiny_model, tiny_tokenizer):
    """The same requests through 1, 3 or 8 slots, in shuffled orders, with and without prefix
    reuse: every request's tokens, logprobs and routing are the same bits."""
    first = [tiny_tokenizer.encode(t) for t in TEXTS]
    rounds = [first, [first[-1] + tiny_tokenizer.encode(" more"), first[0] + tiny_tokenizer.encode(" + 1")]]
    ref = _run(
        Engine(tiny_model, tiny_tokenizer, max_batch=1, max_len=256, deterministic=True, reuse_min=0), rounds, None
    )
    rng = random.Random(0)
    for slots, reuse in ((3, 8), (8, 8), (3, 0)):
        eng = Engine(tiny_model, tiny_tokenizer, max_batch=slots, max_len=256, deterministic=True, reuse_min=reuse)
        for o, r in zip(_run(eng, rounds, rng), ref):
            assert o.token_ids == r.token_ids and o.logprobs == r.logprobs
            assert (o.routing is None) == (r.routing is None)
            assert o.routing is None or (o.routing == r.routing).all()
        assert (eng.prefix_reused_tokens > 0) == (reuse > 0)


def test_engine_equals_trainer_bitwise(tiny_model, tiny_tokenizer):
    rng = random.Random(0)
    prompts = [tiny_tokenizer.encode(t) for t in TEXTS]  # the last prefills > MOE_GROUP rows per expert
    order = list(range(len(prompts)))
    rng.shuffle(order)
    eng = Engine(tiny_model, tiny_tokenizer, max_batch=3, max_len=256, deterministic=True)
    params = [SamplingParams(max_tokens=8 + 3 * i, seed=i, stop_token_ids=[]) for i in order]
    outs = eng.generate([prompts[i] for i in order], params)  # 6 requests through 3 slots: joins mid-decode
    for o in outs:
        lp, routing = recompute(tiny_model, o.prompt_ids, o.token_ids, deterministic=True)
        assert torch.equal(lp, torch.tensor(o.logprobs)), (lp - torch.tensor(o.logprobs)).abs().max()
        if routing is not None:
            assert (routing.numpy() == o.routing).all()
            replayed, _ = recompute(tiny_model, o.prompt_ids, o.token_ids, routing=o.routing, deterministic=True)
            assert torch.equal(replayed, lp)


def _episodes(engine: Engine, tok, n: int, turns: int, seed: int) -> tuple[list[Segment], list]:
    """n agent-style episodes in lockstep, as the harness records them: each turn's prompt is the
    segment so far (so the engine reuses the previous turn's KV), the generated tokens carry the
    engine's logprobs and routing, a tool observation follows. Returns the segments and each
    episode's last completion (its routing covers every position but the last)."""
    rng = random.Random(seed)
    head = tok.encode("You are a careful coding agent. Read, edit, test, submit.\n" * 2)
    segs = []
    for i in range(n):
        s = Segment()
        s.add_forced(head + tok.encode(f"Task {i}: fix {rng.choice(TEXTS)}\n"))
        segs.append(s)
    last = [None] * n
    for turn in range(turns):
        params = [
            SamplingParams(max_tokens=rng.randint(3, 12), seed=rng.randrange(10**6), stop_token_ids=[]) for _ in segs
        ]
        outs = engine.generate([list(s.input_ids) for s in segs], params)
        for i, (s, o) in enumerate(zip(segs, outs)):
            routing = generated_routing(o.routing, len(o.prompt_ids), len(o.token_ids))
            s.add_generated(o.token_ids, o.logprobs, o.versions, routing)
            last[i] = o
            if turn + 1 < turns:
                s.add_forced(tok.encode(f"\n[tool output {turn}] {rng.choice(TEXTS)}\n"))
    return segs, last


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_ci_gate_engine_and_trainer_agree_bitwise(arch, tiny_tokenizer):
    from strop.model.policy import build_model
    from tests.conftest import tiny_model_section

    model = build_model(tiny_model_section(arch), tiny_tokenizer, seed=1).eval()
    eng = Engine(model, tiny_tokenizer, max_batch=3, max_len=512, deterministic=True, reuse_min=16)
    segs, last = _episodes(eng, tiny_tokenizer, n=5, turns=4, seed=0)
    assert eng.prefix_reused_tokens > 0  # turns extended parked sequences
    n_moe, k = len(moe_blocks(model)), model.config.num_experts_per_tok
    rows = [(s, 1.0, 1.0) for s in segs]
    generated = 0
    for replay in (False, True):
        for at in range(0, len(rows), 2):  # micro-batches of two, right-padded as the trainer pads them
            batch = build_batch(rows[at : at + 2], tiny_tokenizer.pad_token_id)
            with ExitStack() as stack:
                stack.enter_context(det.deterministic_mode(model))
                if replay:
                    stack.enter_context(router_replay(model, batch))
                records = stack.enter_context(capture_routing(model))
                with torch.no_grad():
                    lp = token_logprobs(model, batch)
            mask = batch.mask_BT
            assert torch.equal(lp[mask], batch.behavior_BT[mask]), (
                f"{int((lp[mask] != batch.behavior_BT[mask]).sum())} tokens differ"
            )
            generated += int(mask.sum())
            trainer = stack_routing(records, tuple(batch.input_ids_BT.shape), moe_blocks(model)[0].gate.num_experts)
            for b, o in enumerate(last[at : at + 2]):  # every position each sequence's last request read
                engine_routing = torch.as_tensor(o.routing).reshape(-1, n_moe, k)
                assert routing_flip_rate(engine_routing, trainer[b, : len(engine_routing)]) == 0.0
    assert generated == 2 * sum(sum(s.loss_mask) for s in segs)


def test_bitwise_in_bf16_serving_dtype(tiny_moe, tiny_tokenizer):
    model = tiny_moe.to(torch.bfloat16)  # deterministic mode computes in fp32 from the bf16 weights
    eng = Engine(model, tiny_tokenizer, max_batch=2, max_len=128, deterministic=True)
    prompts = [tiny_tokenizer.encode(t) for t in ("def f(x):", "import os\nimport sys", "x = 1")]
    for o in eng.generate(prompts, SamplingParams(max_tokens=10, seed=0, stop_token_ids=[])):
        lp, routing = recompute(model, o.prompt_ids, o.token_ids, routing=o.routing, deterministic=True)
        assert torch.equal(lp, torch.tensor(o.logprobs)) and (routing.numpy() == o.routing).all()


def test_deterministic_trainer_forward_trains(tiny_model):
    """Values from the kernels, gradients from torch: they match autograd through the Hugging Face
    forward to rounding, for every parameter of every architecture."""
    ids = torch.randint(0, 500, (3, 20), generator=torch.Generator().manual_seed(0))
    tiny_model.zero_grad(set_to_none=True)
    ref = tiny_model(ids).logits
    ref.float().logsumexp(-1).mean().backward()
    ref_grads = {n: p.grad for n, p in tiny_model.named_parameters() if p.grad is not None}
    tiny_model.zero_grad(set_to_none=True)
    with det.deterministic_mode(tiny_model):
        out = tiny_model(ids).logits
        out.logsumexp(-1).mean().backward()
    assert torch.allclose(out, ref, atol=1e-5)
    grads = {n: p.grad for n, p in tiny_model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], atol=1e-5 * float(ref_grads[name].abs().max()) + 1e-9), name
    assert "forward" not in tiny_model.model.__dict__  # the patch is undone on exit
    tiny_model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("dk,dv", [(16, 16), (24, 16), (8, 24)])
def test_sequence_attention_gradients(dk, dv):
    """The trainer's attention: values as the engine computes them over its cache, gradients
    (query, key and value widths equal or not, grouped heads) those of torch's attention."""
    gen = torch.Generator().manual_seed(0)
    B, T, nq, nk = 2, 30, 4, 2
    q, k = torch.randn(B * T, nq, dk, generator=gen), torch.randn(B * T, nk, dk, generator=gen)
    v, g = torch.randn(B * T, nk, dv, generator=gen), torch.randn(B * T, nq, dv, generator=gen)
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    out = kernel_ops.sequence_attention(*ours, B, T, 0.3)
    out.backward(g)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    qh, kh, vh = (t.view(B, T, t.shape[1], -1).transpose(1, 2) for t in ref)
    expect = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=0.3, enable_gqa=True)
    expect = expect.transpose(1, 2).reshape(B * T, nq, dv)
    expect.backward(g)
    assert torch.allclose(out, expect, atol=1e-5)
    for a, b in zip(ours, ref):
        assert torch.allclose(a.grad, b.grad, atol=1e-4)


def test_deterministic_mode_refuses_what_it_does_not_compute(tiny_moe, tiny_tokenizer, monkeypatch):
    ids = torch.randint(0, 500, (2, 8))
    with det.deterministic_mode(tiny_moe):
        with pytest.raises(ValueError, match="right-padded"):
            tiny_moe(ids, attention_mask=torch.tensor([[1] * 8, [0] + [1] * 7]))
        with pytest.raises(ValueError, match="KV cache"):
            tiny_moe(ids, use_cache=True)
    monkeypatch.setattr(kernels, "available", lambda: False)  # as on a machine without a C compiler
    with pytest.raises(ValueError, match="C compiler"):
        Engine(tiny_moe, tiny_tokenizer, max_batch=2, max_len=64, deterministic=True)
    with pytest.raises(ValueError, match="C compiler"), det.deterministic_mode(tiny_moe):
        pass


def test_kept_packs_follow_weight_updates():
    w, x = torch.randn(32, 16).bfloat16(), torch.randn(3, 16)
    with torch.no_grad():
        a = kernel_ops.linear(x, w)  # packed once, kept
        w.mul_(2)  # in place through torch: its version counter moves
        assert torch.equal(kernel_ops.linear(x, w), a * 2)
        w.view(torch.int16).numpy()[:] = (w * 2).view(torch.int16).numpy()  # unseen by the version counter
        kernel_ops.forget_packs()
        assert torch.equal(kernel_ops.linear(x, w), a * 4)
