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
