"""The CPU engine: continuous batching, sampling parameters, stops, seeds, in-flight weight updates."""

import time

import pytest
import torch

from strop.engine.engine import Engine, SamplingParams


def _prompts(tok, n):
    texts = ["def f(x):\n", "import os\n", "class A:\n    pass\n", "x = 1\n" * 3, "for i in range(3):\n", "return"]
    return [tok.encode(texts[i % len(texts)]) for i in range(n)]


def test_continuous_batching_more_requests_than_slots(tiny_model, tiny_tokenizer):
    eng = Engine(tiny_model, tiny_tokenizer, max_batch=2, max_len=128)
    prompts = _prompts(tiny_tokenizer, 5)
    outs = eng.generate(prompts, [SamplingParams(max_tokens=3 + i, stop_token_ids=[]) for i in range(5)])
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o.finish_reason == "length" and len(o.token_ids) == 3 + i
        assert len(o.logprobs) == len(o.versions) == len(o.token_ids)
        assert all(lp <= 0 for lp in o.logprobs) and o.versions == [0] * len(o.token_ids)
        if o.routing is not None:  # every position the model read: prompt + all but the last token
            k = tiny_model.config.num_experts_per_tok
            assert o.routing.shape == (len(p) + len(o.token_ids) - 1, 2, k) and o.routing.dtype.name == "uint8"
    assert sorted(eng._free) == [0, 1]


def test_greedy_matches_hf_argmax(tiny_moe, tiny_tokenizer):
    eng = Engine(tiny_moe, tiny_tokenizer, max_batch=4, max_len=128)
    p = _prompts(tiny_tokenizer, 1)[0]
    out = eng.generate([p], SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[]))[0]
    ids = torch.tensor([p])
    for t in out.token_ids:
        with torch.no_grad():
            nxt = int(tiny_moe(ids).logits[0, -1].argmax())
        assert nxt == t
        ids = torch.cat([ids, torch.tensor([[t]])], 1)


def test_seed_reproducible_and_top_p_logprob(tiny_moe, tiny_tokenizer):
    eng = Engine(tiny_moe, tiny_tokenizer, max_batch=4, max_len=128)
    p = _prompts(tiny_tokenizer, 1)[0]
    sp = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, stop_token_ids=[])
    a, b = eng.generate([p, p], [sp, sp])
    assert a.token_ids == b.token_ids
    tiny = eng.generate([p], SamplingParams(max_tokens=4, top_p=1e-6, stop_token_ids=[]))[0]
    assert tiny.logprobs == [0.0] * 4  # only the top token survives top-p: probability 1


def test_stop_string_and_stop_token(tiny_moe, tiny_tokenizer):
    eng = Engine(tiny_moe, tiny_tokenizer, max_batch=2, max_len=128)
    p = _prompts(tiny_tokenizer, 1)[0]
    free = eng.generate([p], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[]))[0]
    first = free.token_ids[2]
    stopped = eng.generate([p], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[first]))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: free.token_ids.index(first) + 1]
    word = tiny_tokenizer.decode(free.token_ids[3:5])
    cut = eng.generate([p], SamplingParams(max_tokens=12, temperature=0, stop=[word], stop_token_ids=[]))[0]
    assert cut.finish_reason == "stop" and word not in cut.text and free.text.startswith(cut.text)


def test_bad_requests_raise(tiny_moe, tiny_tokenizer):
    eng = Engine(tiny_moe, tiny_tokenizer, max_batch=2, max_len=32)
    for prompt, sp in [([], None), ([1] * 40, None), ([10 ** 6], None), ([1, 2], SamplingParams(top_p=0))]:
        with pytest.raises(ValueError):
            eng.submit(prompt, sp)


def test_weight_update_in_flight(tiny_moe, tiny_tokenizer):
    eng = Engine(tiny_moe, tiny_tokenizer, max_batch=4, max_len=256)
    eng.start()
    try:
        reqs = [eng.submit(p, SamplingParams(max_tokens=60, stop_token_ids=[])) for p in _prompts(tiny_tokenizer, 6)]
        deadline = time.time() + 20
        while sum(len(r.token_ids) for r in reqs) < 10 and time.time() < deadline:
            time.sleep(0.005)
        new = {"lm_head.weight": tiny_moe.lm_head.weight.detach() * 1.5}  # tied: scales the embeddings too
        pause = eng.update_weights(tensors=new).wait(20)
        assert eng.update_weights(apply_fn=lambda named: named["model.norm.weight"].mul_(0.5)).wait(20) >= 0
        for r in reqs:
            assert r.done.wait(30)
    finally:
        eng.stop()
    assert pause >= 0 and len(eng.pauses) == 2 and eng.version == 2
    outs = [r.result for r in reqs]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 60 for o in outs)
    for o in outs:
        assert o.versions == sorted(o.versions)  # a token's version is the weights that sampled it
    assert any(o.versions[0] == 0 and o.versions[-1] == 2 for o in outs)  # updated mid-request, not dropped
    with pytest.raises(ValueError):
        eng.update_weights(tensors={"nope": torch.zeros(1)}).wait(5)


def test_failing_callback_does_not_break_the_engine(tiny_moe, tiny_tokenizer, capsys):
    eng = Engine(tiny_moe, tiny_tokenizer, max_batch=2, max_len=64)

    def boom(req):
        raise RuntimeError("caller bug")

    bad = eng.submit(tiny_tokenizer.encode("x = 1"), SamplingParams(max_tokens=3, stop_token_ids=[]), on_token=boom)
    good = eng.generate([tiny_tokenizer.encode("y = 2")], SamplingParams(max_tokens=3, stop_token_ids=[]))[0]
    assert bad.done.is_set() and len(bad.result.token_ids) == 3 and len(good.token_ids) == 3
    assert "caller bug" in capsys.readouterr().err


def _nucleus_reference(probs, top_p):
    """Smallest-probability-inside-the-nucleus per row, by a full sort (the textbook definition)."""
    s = probs.sort(-1, descending=True).values
    kept = ((s.cumsum(-1) - s) < top_p).sum(-1)
    return s.gather(1, (kept - 1)[:, None])


def test_top_p_sampler_keeps_the_sorted_nucleus():
    from strop.engine import kernels, sampling

    gen = torch.Generator().manual_seed(0)
    samplers = [sampling._sample_torch] + ([kernels.sample_top_p] if kernels.available() else [])
    for scale in (0.05, 1.0, 5.0):  # near-uniform (random init) to peaked rows
        probs = torch.softmax(torch.randn(8, 4096, generator=gen) * scale, -1)
        for p in (1e-6, 0.5, 0.95, 1.0):
            t = _nucleus_reference(probs, p) if p < 1 else torch.zeros(8, 1)
            mass = torch.where(probs >= t, probs, 0.0).sum(-1)
            u = 1 - torch.rand(8, generator=gen)
            picks = [f(probs, torch.full((8,), p), u) for f in samplers]
            for tok, ratio in picks:
                chosen = probs.gather(1, tok[:, None])[:, 0]
                assert (chosen >= t[:, 0]).all() and torch.allclose(ratio, chosen / mass, rtol=1e-5)
            assert all(torch.equal(tok, picks[0][0]) for tok, _ in picks)  # the same token for the same uniform
    rows = torch.softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]), -1).expand(40000, -1).contiguous()
    for f in samplers:  # frequencies follow the renormalised nucleus {0, 1, 2} of top_p 0.8
        tok, _ = f(rows, torch.full((40000,), 0.8), 1 - torch.rand(40000, generator=gen))
        freq = torch.bincount(tok, minlength=5) / 40000
        want = torch.cat([rows[0, :3] / rows[0, :3].sum(), torch.zeros(2)])
        assert (freq - want).abs().max() < 0.01


def test_kernels_match_torch():
    from strop.engine import kernels

    if not kernels.available():
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(0)
    for d in (32, 64, 16):  # head widths with their own inlined kernel, and the generic one
        kc, vc = torch.randn(4, 2, 96, d, generator=gen), torch.randn(4, 2, 96, d, generator=gen)
        q, slots, pos = torch.randn(3, 4, d, generator=gen), torch.tensor([0, 2, 3]), torch.tensor([5, 40, 95])
        out = kernels.decode_attention(q, kc, vc, slots, pos, 0.2)
        for i in range(3):  # one query row against its slot's keys 0..pos
            T = int(pos[i]) + 1
            ref = torch.nn.functional.scaled_dot_product_attention(q[i][None, :, None], kc[slots[i]][None, :, :T],
                                                                   vc[slots[i]][None, :, :T], scale=0.2, enable_gqa=True)
            assert torch.allclose(out[i], ref[0, :, 0], atol=1e-5)

    class Experts(torch.nn.Module):
        gate_up_proj = torch.randn(8, 64, 64, generator=gen) * 0.1
        down_proj = torch.randn(8, 64, 32, generator=gen) * 0.1

    ex = Experts()
    for n in (1, 5, 40):  # one row per expert, pairs, groups of four
        x, w = torch.randn(n, 64, generator=gen), torch.rand(n, 2, generator=gen)
        ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(n)])
        gate, up = torch.einsum("nkih,nh->nki", ex.gate_up_proj[ids], x).chunk(2, -1)
        ref = (torch.einsum("nkhi,nki->nkh", ex.down_proj[ids], torch.nn.functional.silu(gate) * up) * w[..., None]).sum(1)
        assert torch.allclose(kernels.moe_experts(x, ids, w, *kernels.pack_experts(ex)), ref, atol=1e-5)

    # weights that are bf16 values (as the trainer ships them) pack as bf16, with the very same result bits
    Experts.gate_up_proj = Experts.gate_up_proj.bfloat16().float()
    Experts.down_proj = Experts.down_proj.bfloat16().float()
    packed16 = kernels.pack_experts(ex)
    assert packed16[0].dtype == torch.bfloat16 and packed16[1].dtype == torch.bfloat16
    packed32 = tuple(t.float() for t in packed16)
    for n in (1, 5, 40):
        x, w = torch.randn(n, 64, generator=gen), torch.rand(n, 2, generator=gen)
        ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(n)])
        assert torch.equal(kernels.moe_experts(x, ids, w, *packed16), kernels.moe_experts(x, ids, w, *packed32))

    for V in (4096, 100):  # the sampler's softmax, with and without a tail past whole 32-blocks
        x = torch.randn(3, V, generator=gen) * 4
        assert torch.allclose(kernels.softmax(x), torch.softmax(x, -1), rtol=1e-5, atol=0)

    head = torch.randn(96, 64, generator=gen)  # the output head: packed only when its values are bf16
    assert kernels.pack_head(head) is None
    head = head.bfloat16().float()
    for n in (1, 2, 3, 5, 6, 11, 16):  # every row-tile shape of the matrix kernels
        x = torch.randn(n, 64, generator=gen)
        assert torch.allclose(kernels.head_logits(x, kernels.pack_head(head)), x @ head.T, atol=1e-4)


def test_weight_update_refreshes_packed_weights(tiny_moe, tiny_tokenizer):
    eng = Engine(tiny_moe, tiny_tokenizer, max_batch=2, max_len=64)
    p = _prompts(tiny_tokenizer, 1)[0]
    eng.generate([p], SamplingParams(max_tokens=2, temperature=0, stop_token_ids=[]))
    experts = tiny_moe.model.layers[0].mlp.experts
    new = {"model.layers.0.mlp.experts.down_proj": experts.down_proj.detach() * -3,
           "model.layers.1.self_attn.o_proj.weight": tiny_moe.model.layers[1].self_attn.o_proj.weight.detach() * 2}
    eng.update_weights(tensors=new).wait(10)
    out = eng.generate([p], SamplingParams(max_tokens=4, temperature=0, stop_token_ids=[]))[0]
    ids = torch.tensor([p])
    for t in out.token_ids:  # the engine's derived copies (fused, packed) follow the update
        with torch.no_grad():
            assert int(tiny_moe(ids).logits[0, -1].argmax()) == t
        ids = torch.cat([ids, torch.tensor([[t]])], 1)


@pytest.mark.parametrize("bf16_values", [False, True])
def test_decode_step_matches_layer_by_layer(tiny_moe, tiny_tokenizer, bf16_values):
    from strop.engine import kernels
    from strop.engine.forward import Forward, Segment

    if not kernels.available():
        pytest.skip("no C compiler")
    if bf16_values:  # as an RL engine holds them: bf16 experts and a packed bf16 head
        with torch.no_grad():
            for p in tiny_moe.parameters():
                p.copy_(p.bfloat16().float())
    fw = Forward(tiny_moe, max_slots=4, max_len=64)
    assert fw._step is not None and fw._step.has_head == bf16_values
    prompts = _prompts(tiny_tokenizer, 3)
    fw([Segment(s, 0, p) for s, p in zip((0, 2, 3), prompts)])
    segments = [Segment(s, len(p), [7 + s]) for s, p in zip((0, 2, 3), prompts)]
    logits, ids = fw(segments)  # one C call
    fw._step = None
    ref_logits, ref_ids = fw(segments)  # kernel by kernel, the router in torch (rewrites the same cache rows)
    assert torch.allclose(logits, ref_logits, atol=1e-5) and torch.equal(ids, ref_ids)
