"""The CPU engine: continuous batching, sampling parameters, stops, seeds, in-flight weight updates."""

import time

import numpy as np
import pytest
import torch

from strop.engine.engine import Engine
from strop.policy_api import SamplingParams


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


def test_generate_from_many_threads_without_the_loop_thread(tiny_moe, tiny_tokenizer):
    """Callers on several threads share an engine that was never started: one steps for all at a
    time (stepping it from two threads at once had corrupted its state)."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = _prompts(tiny_tokenizer, 12)
    greedy = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[])
    alone = Engine(tiny_moe, tiny_tokenizer, max_batch=4, max_len=128).generate(prompts, greedy)
    shared = Engine(tiny_moe, tiny_tokenizer, max_batch=4, max_len=128)
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda p: shared.generate([p], greedy)[0], prompts))
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert sorted(shared._free + list(shared._parked)) == [0, 1, 2, 3]


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
    for prompt, sp in [([], None), ([1] * 40, None), ([10**6], None), ([1, 2], SamplingParams(top_p=0))]:
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
        # Both queued before waiting on either, so they land while the first requests still decode
        # (waiting between them let a descheduled test thread see those requests finish first).
        first = eng.update_weights(tensors=new)
        second = eng.update_weights(apply_fn=lambda named: named["model.norm.weight"].mul_(0.5))
        pause = first.wait(20)
        assert second.wait(20) >= 0
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
    """The C sampler and its numpy fallback keep the textbook nucleus, pick the same token for the
    same uniform, take the argmax on greedy rows, and draw with the renormalised nucleus' frequencies."""
    from strop import kernels
    from strop.engine import sampling

    def compiled(x, top_p, u, greedy):
        return kernels.sample_rows(x, top_p, u, greedy)[1:]

    gen = torch.Generator().manual_seed(0)
    samplers = [sampling._sample_numpy] + ([compiled] if kernels.available() else [])
    for scale in (0.05, 1.0, 5.0):  # near-uniform (random init) to peaked rows
        logits = torch.randn(8, 4096, generator=gen) * scale
        probs = torch.softmax(logits, -1)
        greedy = np.array([0] * 6 + [1] * 2, np.int64)
        for p in (1e-6, 0.5, 0.95, 1.0):
            t = _nucleus_reference(probs, p) if p < 1 else torch.zeros(8, 1)
            mass = torch.where(probs >= t, probs, 0.0).sum(-1)
            u = (1 - torch.rand(8, generator=gen)).numpy()
            picks = [f(logits.numpy(), np.full(8, p, np.float32), u, greedy) for f in samplers]
            for tok, ratio in picks:
                tok, ratio = torch.from_numpy(tok), torch.from_numpy(ratio)
                chosen = probs.gather(1, tok[:, None])[:, 0]
                assert (chosen >= t[:, 0]).all() and torch.allclose(ratio, chosen / mass, rtol=1e-5)
                assert torch.equal(tok[6:], logits[6:].argmax(-1))
            assert all((tok == picks[0][0]).all() for tok, _ in picks)  # the same token for the same uniform
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    logits = row.expand(40000, -1).contiguous().numpy()
    for f in samplers:  # frequencies follow the renormalised nucleus {0, 1, 2} of top_p 0.8
        u = (1 - torch.rand(40000, generator=gen)).numpy()
        tok, _ = f(logits, np.full(40000, 0.8, np.float32), u, np.zeros(40000, np.int64))
        freq = torch.bincount(torch.from_numpy(tok), minlength=5) / 40000
        probs = torch.softmax(row, -1)
        want = torch.cat([probs[:3] / probs[:3].sum(), torch.zeros(2)])
        assert (freq - want).abs().max() < 0.01


def test_uniforms_are_the_generators_one_draw_at_a_time():
    """The sampler's uniforms, drawn a block at a time, are the values a torch draw per token gave:
    an engine made faster samples the same tokens for the same seed."""
    from strop.engine.sampling import Uniforms

    uniforms, generator = Uniforms(3), torch.Generator().manual_seed(3)
    n = 2 * Uniforms.BLOCK + 5
    assert [uniforms.draw() for _ in range(n)] == [float(torch.rand(1, generator=generator)) for _ in range(n)]


def test_weight_update_refreshes_packed_weights(tiny_moe, tiny_tokenizer):
    eng = Engine(tiny_moe, tiny_tokenizer, max_batch=2, max_len=64)
    p = _prompts(tiny_tokenizer, 1)[0]
    eng.generate([p], SamplingParams(max_tokens=2, temperature=0, stop_token_ids=[]))
    experts = tiny_moe.model.layers[0].mlp.experts
    new = {
        "model.layers.0.mlp.experts.down_proj": experts.down_proj.detach() * -3,
        "model.layers.1.self_attn.o_proj.weight": tiny_moe.model.layers[1].self_attn.o_proj.weight.detach() * 2,
    }
    eng.update_weights(tensors=new).wait(10)
    out = eng.generate([p], SamplingParams(max_tokens=4, temperature=0, stop_token_ids=[]))[0]
    ids = torch.tensor([p])
    for t in out.token_ids:  # the engine's derived copies (fused, packed) follow the update
        with torch.no_grad():
            assert int(tiny_moe(ids).logits[0, -1].argmax()) == t
        ids = torch.cat([ids, torch.tensor([[t]])], 1)


@pytest.mark.parametrize("bf16_values", [False, True])
def test_one_call_step_equals_the_kernels_one_by_one(tiny_moe, tiny_tokenizer, bf16_values):
    """The C step (qwen3_moe) chains the kernels `strop.model.deterministic` calls one at a time:
    the same bits for prefills, decode rows and a mix of both, with weights packed as bf16 (values
    that are bf16, as an RL engine holds them) or fp32."""
    from strop import kernels
    from strop.engine.forward import Forward, Segment

    if not kernels.available():
        pytest.skip("no C compiler")
    if bf16_values:
        with torch.no_grad():
            for p in tiny_moe.parameters():
                p.copy_(p.bfloat16().float())
    fw = Forward(tiny_moe, max_slots=4, max_len=64)
    assert fw._step is not None
    prompts = _prompts(tiny_tokenizer, 3)
    batches = [
        [Segment(s, 0, p) for s, p in zip((0, 2, 3), prompts)],
        [Segment(s, len(p), [7 + s]) for s, p in zip((0, 2, 3), prompts)],
        [Segment(0, len(prompts[0]) + 1, [9]), Segment(1, 0, prompts[1] + [5, 6])],
    ]
    results = []
    for step in (fw._step, None):  # the same calls, so every call sees the same cache contents
        fw._step = step
        results.append([fw(segments) for segments in batches])
    for (logits, ids), (ref_logits, ref_ids) in zip(*results):
        assert torch.equal(logits, ref_logits) and torch.equal(ids, ref_ids)
