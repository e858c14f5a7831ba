"""Prefix reuse: a finished request's KV stays parked in its slot, and a later prompt that starts
with it prefills only the rest; outputs are those of a full prefill (bitwise in deterministic mode)."""

import pytest
import torch

from strop.engine.engine import Engine
from strop.model.mismatch import recompute
from strop.policy_api import SamplingParams

TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"


def _greedy(n: int, seed: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, stop_token_ids=[], seed=seed)


def _episode(eng: Engine, tok, first: list[int], turns: int = 3) -> list:
    """An agent-style episode: each prompt is the previous prompt + its completion + an observation."""
    prompt, outs = first, []
    for t in range(turns):
        o = eng.generate([prompt], _greedy(6 + t))[0]
        outs.append(o)
        prompt = prompt + o.token_ids + tok.encode(f"\nresult {t}: ok\n")
    return outs


def _check_routing(o) -> None:
    if o.routing is not None:  # every position read: the reused prefix's routing is kept
        assert o.routing.shape[0] == len(o.prompt_ids) + len(o.token_ids) - 1


@pytest.mark.parametrize("deterministic", [False, True])
def test_next_turn_reuses_the_previous_turn(tiny_model, tiny_tokenizer, deterministic):
    from strop import kernels

    if deterministic and not kernels.available():
        pytest.skip("deterministic mode needs the C kernels")
    tok = tiny_tokenizer
    first = tok.encode(TEXT)
    assert len(first) >= 32
    eng = Engine(tiny_model, tok, max_batch=2, max_len=256, deterministic=deterministic)
    ref = Engine(tiny_model, tok, max_batch=2, max_len=256, deterministic=deterministic, reuse_min=0)
    outs, refs = _episode(eng, tok, first), _episode(ref, tok, first)
    # Turns 2 and 3 reuse everything of the previous turn whose KV was cached: prompt + completion - 1.
    expect = sum(len(o.prompt_ids) + len(o.token_ids) - 1 for o in outs[:-1])
    assert eng.stats()["prefix_reused_tokens"] == expect and ref.stats()["prefix_reused_tokens"] == 0
    assert eng.prefilled_tokens + expect == ref.prefilled_tokens == sum(len(o.prompt_ids) for o in refs)
    assert eng.stats()["parked"] == 1  # the last turn's sequence, in the slot the episode kept
    for o, r in zip(outs, refs):
        assert o.token_ids == r.token_ids and o.prompt_ids == r.prompt_ids
        _check_routing(o)
        if deterministic:  # a suffix prefilled against cached keys gives the full prefill's bits
            assert o.logprobs == r.logprobs
            assert (o.routing is None) == (r.routing is None) and (o.routing is None or (o.routing == r.routing).all())
            lp, routing = recompute(tiny_model, o.prompt_ids, o.token_ids, deterministic=True)
            assert torch.equal(lp, torch.tensor(o.logprobs))
            assert routing is None or (routing.numpy() == o.routing).all()
        else:
            assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(r.logprobs), atol=1e-4)


def test_shared_prefix_is_copied_and_the_parked_entry_kept(tiny_moe, tiny_tokenizer):
    tok = tiny_tokenizer
    head = tok.encode(TEXT)
    a, b = head + tok.encode("    def norm(self):\n"), head + tok.encode("import os\n")
    eng = Engine(tiny_moe, tok, max_batch=4, max_len=256)
    ref = Engine(tiny_moe, tok, max_batch=4, max_len=256, reuse_min=0)
    oa = eng.generate([a], _greedy(5))[0]
    ob = eng.generate([b], _greedy(5))[0]  # shares `head` with a's parked sequence: copied, not taken over
    shared = min(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert eng.prefix_reused_tokens == shared and eng.stats()["parked"] == 2
    oa2 = eng.generate([a + oa.token_ids], _greedy(5))[0]  # a's own entry survived: its next turn reuses it all
    assert eng.prefix_reused_tokens == shared + len(a) + len(oa.token_ids) - 1
    for o, r in zip((oa, ob, oa2), ref.generate([a, b, a + oa.token_ids], _greedy(5))):
        assert o.token_ids == r.token_ids and (o.routing == r.routing).all()
        _check_routing(o)


def test_parked_slots_are_evicted_least_recent_first(tiny_moe, tiny_tokenizer):
    tok = tiny_tokenizer
    p = [tok.encode(f"# file {i}\n" + TEXT) for i in range(4)]
    eng = Engine(tiny_moe, tok, max_batch=2, max_len=256, reuse_min=8)
    oa, ob = eng.generate([p[0]], _greedy(4))[0], eng.generate([p[1]], _greedy(4))[0]
    assert eng.stats()["parked"] == 2 and not eng._free
    # Both slots are parked; an unrelated request evicts the least recently parked one, a's.
    eng.generate([tok.encode("x = 1\n" * 12)], _greedy(4))
    assert eng.prefix_reused_tokens == 0 and eng.stats()["parked"] == 2
    before = eng.prefix_reused_tokens
    ob2 = eng.generate([p[1] + ob.token_ids], _greedy(4))[0]  # b is still parked
    assert eng.prefix_reused_tokens - before == len(p[1]) + 3
    before = eng.prefix_reused_tokens
    oa2 = eng.generate([p[0] + oa.token_ids], _greedy(4))[0]  # a was evicted: a full prefill
    assert eng.prefix_reused_tokens == before
    # More requests than slots, all at once: every slot in use, parked ones evicted as needed.
    outs = eng.generate(p + [p[0] + oa.token_ids], [_greedy(3 + i) for i in range(5)])
    ref = Engine(tiny_moe, tok, max_batch=2, max_len=256, reuse_min=0)
    refs = ref.generate(
        [p[1] + ob.token_ids, p[0] + oa.token_ids] + p + [p[0] + oa.token_ids],
        [_greedy(4), _greedy(4)] + [_greedy(3 + i) for i in range(5)],
    )
    for o, r in zip([ob2, oa2] + outs, refs):
        assert o.token_ids == r.token_ids and o.finish_reason == "length"
        _check_routing(o)
    assert len(eng._parked) + len(eng._free) == 2


def test_reuse_after_a_weight_update_keeps_the_old_prefix(tiny_moe, tiny_tokenizer):
    """Parked KV from older weights is reused (as in-flight updates keep a running prefix); the new
    tokens carry the new version."""
    tok = tiny_tokenizer
    first = tok.encode(TEXT)
    eng = Engine(tiny_moe, tok, max_batch=2, max_len=256)
    o1 = eng.generate([first], _greedy(4))[0]
    eng.update_weights({"lm_head.weight": tiny_moe.lm_head.weight * 1.0}).wait()
    o2 = eng.generate([first + o1.token_ids], _greedy(4))[0]
    assert eng.prefix_reused_tokens == len(first) + 3 and o1.versions == [0] * 4 and o2.versions == [1] * 4


def test_a_server_engine_drops_parked_kv_at_an_update(tiny_moe, tiny_tokenizer):
    """With `stale_prefixes=False` (`strop serve`) nothing computed by older weights is reused: after
    going to new weights and back, a prompt gets what the first weights gave it, bit for bit."""
    tok = tiny_tokenizer
    prompt = tok.encode(TEXT)
    old = {k: t.clone() for k, t in tiny_moe.state_dict().items() if k.endswith("q_proj.weight")}
    eng = Engine(tiny_moe, tok, max_batch=2, max_len=256, stale_prefixes=False)
    before = eng.generate([prompt], _greedy(6))[0]
    eng.update_weights({k: t * 1.5 for k, t in old.items()}, version=1).wait()
    assert eng.stats()["parked"] == 0
    moved = eng.generate([prompt], _greedy(6))[0]
    eng.update_weights(old, version=0, rollback=True).wait()
    again = eng.generate([prompt], _greedy(6))[0]
    assert moved.logprobs != before.logprobs and eng.prefix_reused_tokens == 0
    assert again.token_ids == before.token_ids and again.logprobs == before.logprobs
