"""Per-tensor repacking in the engine's forward: an update repacks only the derived weights of the
tensors it changed, and a repacking prepared from the new values before they are written (what the
weight sync does off the engine thread) runs exactly like a full rebuild."""

import copy

import torch

from strop.engine.forward import Forward, Segment

CHANGED = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.gate_up_proj", "lm_head.weight"]


def _logits(fwd: Forward) -> torch.Tensor:
    prompt = fwd([Segment(0, 0, list(range(5, 25)))])[0]
    step = fwd([Segment(0, 20, [7])])[0]  # a decode row: the one-call C step when compiled
    return torch.cat([prompt, step])


def _bf16_valued(model):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    return model


def test_prepared_repacking_of_changed_tensors_equals_a_full_rebuild(tiny_moe):
    model = _bf16_valued(copy.deepcopy(tiny_moe))
    fwd = Forward(model, max_slots=2, max_len=64)
    before = _logits(fwd)
    named = dict(model.named_parameters(remove_duplicate=False))
    untouched = fwd._fused[id(model.model.layers[1].self_attn)], fwd._packed[id(model.model.layers[1].mlp.experts)]
    new = {n: (named[n] * 1.25).to(torch.bfloat16).float() for n in CHANGED}
    derived = fwd.prepare(CHANGED, new)
    assert torch.equal(_logits(fwd), before)  # prepared, not yet installed: the forward is unchanged
    with torch.no_grad():
        for n, t in new.items():
            named[n].copy_(t)
    fwd.install(derived)
    # only the touched layer's and the head's derived weights were rebuilt
    assert fwd._fused[id(model.model.layers[1].self_attn)] is untouched[0]
    assert fwd._packed[id(model.model.layers[1].mlp.experts)] is untouched[1]
    rebuilt = Forward(model, max_slots=2, max_len=64)
    assert torch.equal(_logits(fwd), _logits(rebuilt)) and not torch.equal(_logits(fwd), before)
