"""Per-tensor repacking in the engine's forward: an update repacks only the derived weights of the
tensors it changed, and a repacking prepared from the new values before they are written (what the
weight sync does off the engine thread) runs exactly like a full rebuild, on every path: the C
step's packs (qwen3_moe), the kernels' kept packs (deepseek_v3, layer by layer) and the torch
path's fused weights (bf16 weights)."""

import copy

import pytest
import torch

from strop import kernels
from strop.engine.forward import Forward, Segment
from strop.model import kernel_ops


def _logits(fwd: Forward) -> torch.Tensor:
    prompt = fwd([Segment(0, 0, list(range(5, 25)))])[0]
    step = fwd([Segment(0, 20, [7])])[0]  # a decode row
    return torch.cat([prompt, step])


def _bf16_valued(model, dtype=torch.float32):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    return model.to(dtype)


def _changed(model) -> list[str]:
    """A weight of layer 0's attention, one of its MLP, and the head (tied to the embeddings)."""
    names = [n for n, _ in model.named_parameters()]
    return [next(n for n in names if n.startswith(p)) for p in ("model.layers.0.self_attn.", "model.layers.0.mlp.")] + [
        "lm_head.weight"
    ]


def _write_unseen(t: torch.Tensor, value: torch.Tensor) -> None:
    """Write through a numpy view, as the weight-sync patcher does: torch's version counter stays."""
    as_int = torch.int16 if t.element_size() == 2 else torch.int32
    t.detach().view(-1).view(as_int).numpy()[:] = value.detach().reshape(-1).view(as_int).numpy()


@pytest.mark.parametrize(
    "arch,dtype", [("qwen3_moe", torch.float32), ("deepseek_v3", torch.float32), ("qwen3_moe", torch.bfloat16)]
)
def test_prepared_repacking_of_changed_tensors_equals_a_full_rebuild(tiny_tokenizer, arch, dtype):
    from strop.model.policy import build_model
    from tests.conftest import tiny_model_section

    model = _bf16_valued(build_model(tiny_model_section(arch), tiny_tokenizer, seed=0).eval(), dtype)
    fwd = Forward(model, max_slots=2, max_len=64)
    if fwd.kernel_path != (dtype == torch.float32):
        pytest.skip("no C compiler")
    before = _logits(fwd)
    layer1 = model.model.layers[1]
    untouched = {
        "step": fwd._packs and fwd._packs.layers,
        "fused": fwd._fused.get(id(layer1.self_attn)),
        "kept": kernel_ops._packs.get((id(layer1.self_attn.o_proj.weight), "linear")),
    }
    named = dict(model.named_parameters(remove_duplicate=False))
    changed = _changed(model)
    new = {n: (named[n] * 1.25).to(torch.bfloat16).to(dtype) for n in changed}
    derived = fwd.prepare(changed, new)
    assert torch.equal(_logits(fwd), before)  # prepared, not yet installed: the forward is unchanged
    with torch.no_grad():
        for n, t in new.items():
            _write_unseen(named[n], t)
    fwd.install(derived)
    after = _logits(fwd)
    # only the touched layer's and the head's derived weights were rebuilt
    if arch == "qwen3_moe" and dtype == torch.float32:
        assert fwd._packs.layers[1] is untouched["step"][1] and fwd._packs.layers[0] is not untouched["step"][0]
    elif arch == "deepseek_v3":
        assert untouched["kept"] is not None and derived.packs
        assert kernel_ops._packs[(id(layer1.self_attn.o_proj.weight), "linear")] is untouched["kept"]
    else:
        assert fwd._fused[id(layer1.self_attn)] is untouched["fused"]
    rebuilt = Forward(model, max_slots=2, max_len=64)
    assert torch.equal(after, _logits(rebuilt)) and not torch.equal(after, before)


def test_step_packs_widen_to_fp32_when_an_update_leaves_bf16_values(tiny_moe):
    """The C step packs every matrix in one dtype: an update that writes a non-bf16 value repacks all."""
    if not kernels.available():
        pytest.skip("no C compiler")
    model = _bf16_valued(copy.deepcopy(tiny_moe))
    fwd = Forward(model, max_slots=2, max_len=64)
    assert fwd._packs.bf16
    name = "model.layers.0.mlp.experts.down_proj"
    weight = dict(model.named_parameters())[name]
    new = weight.detach() * 1.001  # not bf16 values any more
    derived = fwd.prepare([name], {name: new})
    with torch.no_grad():
        weight.copy_(new)
    fwd.install(derived)
    assert not fwd._packs.bf16 and torch.equal(_logits(fwd), _logits(Forward(model, max_slots=2, max_len=64)))


def test_prepare_refuses_unknown_tensors(tiny_moe):
    fwd = Forward(tiny_moe, max_slots=2, max_len=64)
    with pytest.raises(ValueError, match="no such tensor"):
        fwd.prepare(["model.layers.9.self_attn.q_proj.weight"])
