"""Deterministic mode: engine logprobs equal the trainer's full-sequence forward bit for bit,
whatever the batch composition, prefill vs decode, or request order."""

import random

import torch

from strop.engine.engine import Engine, SamplingParams
from strop.model import deterministic as det
from strop.model.mismatch import recompute


def test_linear_is_batch_invariant():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):  # bf16 multiplies in fp32 on a CPU
        w = torch.randn(96, 64).to(dtype)
        x = torch.randn(300, 64).to(dtype)
        full = det.linear(x, w)
        for m in (1, 2, 7, 9, 16, 17, 40):
            for off in (0, 5):
                assert torch.equal(det.linear(x[off : off + m], w), full[off : off + m])


def test_activations_are_batch_invariant():
    # 24 wide: row counts leave remainders in ATen's AVX2 and AVX-512 loops alike (torch.sigmoid
    # and F.silu fail this on both); a strided slice takes the scalar loop throughout.
    x = torch.randn(300, 24, generator=torch.Generator().manual_seed(0)) * 4
    for f in (det.sigmoid, det.silu):
        full = f(x)
        assert torch.equal(f(x[:, ::3]), full[:, ::3])
        for m in (1, 2, 3, 7, 17):
            for off in (0, 5):
                assert torch.equal(f(x[off : off + m]), full[off : off + m])


def test_attention_ignores_keys_past_the_query():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 10, 8), torch.randn(1, 1, 150, 8), torch.randn(1, 1, 150, 8)
    pos = torch.arange(140, 150)[None]
    full = det.attention(q, k, v, pos, 0.3)
    for i in (0, 9):  # one query against exactly its prefix (a decode step) vs against all 150 keys
        p = int(pos[0, i])
        alone = det.attention(q[:, :, i : i + 1], k[:, :, : p + 1], v[:, :, : p + 1], pos[:, i : i + 1], 0.3)
        assert torch.equal(alone[:, :, 0], full[:, :, i])


def test_engine_equals_trainer_bitwise(tiny_model, tiny_tokenizer):
    rng = random.Random(0)
    texts = ["def f(x):\n    return x", "import os", "class A:\n", "x = [1, 2, 3]\nprint(x)", "while True:", "# note " * 40]  # the last prefills >64 rows: grouped experts
    prompts = [tiny_tokenizer.encode(t) for t in texts]
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


def test_deterministic_trainer_forward_trains(tiny_moe):
    ids = torch.randint(0, 500, (2, 20), generator=torch.Generator().manual_seed(0))
    with det.deterministic_mode(tiny_moe):
        out = tiny_moe(ids).logits
        out.float().logsumexp(-1).mean().backward()
    assert torch.allclose(out, tiny_moe(ids).logits, atol=1e-4)  # the same function, other rounding
    block = tiny_moe.model.layers[0].mlp
    assert block.gate.weight.grad.abs().sum() > 0 and block.experts.gate_up_proj.grad.abs().sum() > 0
    assert torch.nn.functional.linear is not det.linear  # the patch is undone on exit


def test_bitwise_in_bf16_serving_dtype(tiny_moe, tiny_tokenizer):
    model = tiny_moe.to(torch.bfloat16)
    eng = Engine(model, tiny_tokenizer, max_batch=2, max_len=128, deterministic=True)
    prompts = [tiny_tokenizer.encode(t) for t in ("def f(x):", "import os\nimport sys", "x = 1")]
    for o in eng.generate(prompts, SamplingParams(max_tokens=10, seed=0, stop_token_ids=[])):
        lp, routing = recompute(model, o.prompt_ids, o.token_ids, routing=o.routing, deterministic=True)
        assert torch.equal(lp, torch.tensor(o.logprobs)) and (routing.numpy() == o.routing).all()


def test_kept_weight_conversions_follow_updates():
    w, x = torch.randn(8, 16).bfloat16(), torch.randn(3, 16).bfloat16()
    with torch.no_grad():
        a = det.linear(x, w)  # a bf16 weight on a CPU: multiplied in fp32, the fp32 copy kept
        w.mul_(2)  # in place through torch: its version counter moves
        assert torch.equal(det.linear(x, w), a * 2)
        w.view(torch.int16).numpy()[:] = (w * 2).view(torch.int16).numpy()  # unseen by the version counter
        det.forget_conversions()
        assert torch.equal(det.linear(x, w), a * 4)
