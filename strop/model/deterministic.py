"""Deterministic mode: one forward pass, on batch-invariant ops, shared by the engine and the trainer,
so the engine's logprobs and routing equal the trainer's bit for bit.

A GEMM library picks kernels, blocking and thread splits from the matrix shape, so the same row
rounds differently alone (decode), beside 15 others (a decode batch) or beside 2000 (a trainer's
full sequence); in a sparse MoE a last-digit difference in a hidden state can flip a token's
experts. Here every reduction runs on `strop.model.kernel_ops` (the C kernels, whose results for a
row depend on that row alone), the rest is exactly rounded elementwise arithmetic (adds,
products, copies), and rotary tables are built in fixed-size chunks (`rope_tables`), so a token's
numbers depend only on its own sequence.

The model's math is written once, over token rows (`layer`): each row has a position, and
attention and routing come from the caller (`Rows`). The engine runs it over its KV cache with its
own router (`strop.engine.forward`; for qwen3_moe the C step `strop/kernels/step.c` chains the
same kernels in one call); the trainer runs it over whole sequences (`sequence_forward`), through
the MoE gate modules, so routing capture and replay (`strop.model.routing`) apply as to the Hugging
Face forward. `deterministic_mode(model)` makes a Hugging Face policy's own forward
(`model(ids)`, `model.get_decoder()(...)`, `model.lm_head(...)`) run it, with gradients: the
trainer's code is unchanged.

Activations are fp32 whatever the weights' dtype. Unpadded or right-padded batches only (the
causal mask is the only mask; padding rows after a sequence's end change nothing before it);
silu activations only; no KV cache (`use_cache`) and no router logits output.
"""

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from strop import kernels
from strop.model import kernel_ops as ops
from strop.model.routing import moe_blocks, route, sigmoid_weights

ARCHITECTURES = ("qwen3_moe", "qwen3", "deepseek_v3", "llama")
# rotary types whose tables change with the sequence's length: a position's rotation would depend on it
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
ROPE_CHUNK = 256  # positions per rotary-table call: a position's value never depends on the table's length

_tables: dict[int, tuple] = {}  # id(rotary module) -> (weakref, cos [P, d], sin [P, d])


def unsupported(model) -> str | None:
    """Why deterministic mode cannot run this model here, or None when it can."""
    cfg = model.config
    device = next(model.parameters()).device
    if device.type != "cpu":  # never hand a GPU tensor to C code: the engine takes its torch path there
        return f"deterministic mode runs on strop's C kernels, which take CPU tensors only (the model is on {device})"
    if cfg.model_type not in ARCHITECTURES:
        return f"deterministic mode does not implement the {cfg.model_type} architecture"
    if cfg.hidden_act != "silu":
        return f"deterministic mode computes silu activations only, not {cfg.hidden_act}"
    rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type in LENGTH_DEPENDENT_ROPE:
        return f"deterministic mode computes rotary tables by position alone, not {rope_type!r} ones"
    if getattr(cfg, "mlp_bias", False):
        return "deterministic mode computes MLPs without biases"
    if not kernels.available():
        return "deterministic mode runs on strop's C kernels: they need a C compiler (cc) and STROP_NO_KERNELS unset"
    if not all(kernels.experts_fit(b.experts.gate_up_proj) for b in moe_blocks(model)):
        return "deterministic mode needs expert widths (hidden, 2 x intermediate) that are multiples of 32"
    return None


def check_supported(model) -> None:
    """ValueError unless deterministic mode can run this model here."""
    reason = unsupported(model)
    if reason:
        raise ValueError(reason)


def rope_tables(model, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary (cos, sin) for positions 0..n-1 at least, fp32 [P, rotary dims] (P >= n),
    built ROPE_CHUNK positions per call of its rotary module (torch's cos and sin round differently
    in their vector loop and its remainder, so a table built in one call of another length could
    differ in the last bit) and kept until the module is freed."""
    rot = model.model.rotary_emb
    hit = _tables.get(id(rot))
    if hit is None or hit[0]() is not rot:
        weakref.finalize(rot, _tables.pop, id(rot), None)
        hit = (weakref.ref(rot), torch.empty(0, 0), torch.empty(0, 0))
    _, cos, sin = hit
    if cos.shape[0] < n:
        chunks = []
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, even when an engine asks first
            for start in range(cos.shape[0], -(-n // ROPE_CHUNK) * ROPE_CHUNK, ROPE_CHUNK):
                pos = torch.arange(start, start + ROPE_CHUNK)[None]
                chunks.append(rot(torch.zeros(1, dtype=torch.float32), pos))
            cos = torch.cat([cos.reshape(-1, chunks[0][0].shape[-1])] + [c[0][0] for c in chunks])
            sin = torch.cat([sin.reshape(-1, chunks[0][1].shape[-1])] + [c[1][0] for c in chunks])
        _tables[id(rot)] = (hit[0], cos, sin)
    return cos, sin


def rotate_half_tables(model, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_tables` with the rotate-half sign folded into sin (as the C kernels read them): x * cos
    + roll(x, d / 2) * sin is then HF's x * cos + rotate_half(x) * sin, bit for bit."""
    cos, sin = rope_tables(model, n)
    half = cos.shape[-1] // 2
    return cos, sin * torch.cat([-torch.ones(half), torch.ones(half)])


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
Router = Callable[[object, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Rows:
    """What a forward over token rows needs besides the rows: positions [N], and how they attend
    (attend(layer index, q [N, nq, dk], k [N, nk, dk], v [N, nk, dv], scale) -> [N, nq, dv]) and
    route (route(MoE block, x [N, H]) -> (gate weights [N, k], expert ids [N, k]))."""

    positions: torch.Tensor
    attend: Attend
    route: Router


# -- routers --------------------------------------------------------------------------------------


def _is_sigmoid(gate) -> bool:
    return hasattr(gate, "e_score_correction_bias")  # DeepSeek-V3 style


def gate_route(gate, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A gate's (logits [N, E], gate weights [N, k], ids [N, k]) on batch-invariant ops: softmax top-k
    in the C kernel, or DeepSeek's sigmoid scores with group-limited top-k (row-wise torch ops)."""
    logits = ops.linear(x, gate.weight)  # fp32 sums whatever the weight's dtype (DeepSeek's router is fp32)
    if _is_sigmoid(gate):
        weights, ids = route(gate, logits, ops.sigmoid)
        return logits, weights, ids
    weights, ids = ops.route_softmax(logits, gate.num_experts, gate.top_k, gate.norm_topk_prob)
    return logits, weights, ids


def gate_route_at(gate, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Router replay on batch-invariant ops: (logits, gate weights at the recorded ids)."""
    logits = ops.linear(x, gate.weight)
    if _is_sigmoid(gate):
        return logits, sigmoid_weights(gate, ops.sigmoid(logits), ids)
    return logits, ops.route_softmax_at(logits, gate.num_experts, ids, gate.norm_topk_prob)


def _through_gate_module(block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _, weights, ids = block.gate(x)  # the module call: capture hooks and replay see it
    return weights, ids


# -- the model, over token rows -----------------------------------------------------------------


def _norm(mod, x: torch.Tensor) -> torch.Tensor:
    return ops.rms_norm(x, mod.weight, mod.variance_epsilon)


def _gqa_attention(model, li: int, attn, x: torch.Tensor, rows: Rows) -> torch.Tensor:
    N, d = x.shape[0], attn.head_dim
    q = ops.linear(x, attn.q_proj.weight, attn.q_proj.bias)
    k = ops.linear(x, attn.k_proj.weight, attn.k_proj.bias)
    v = ops.linear(x, attn.v_proj.weight, attn.v_proj.bias)
    nq, nk = q.shape[1] // d, k.shape[1] // d
    tables = rotate_half_tables(model, int(rows.positions.max()) + 1)
    if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm of q and k before the rotation
        weight = torch.cat([attn.q_norm.weight.expand(nq, d), attn.k_norm.weight.expand(nk, d)])
        eps = attn.q_norm.variance_epsilon
        qk = ops.qk_norm_rope(torch.cat([q, k], dim=1), weight, eps, tables, rows.positions, nq)
    else:  # Llama: the rotation alone
        qk = ops.rope(torch.cat([q, k], dim=1), nq + nk, tables, rows.positions).view(N, nq + nk, d)
    out = rows.attend(li, qk[:, :nq], qk[:, nq:], v.view(N, nk, d), attn.scaling)
    return ops.linear(out.reshape(N, -1), attn.o_proj.weight, attn.o_proj.bias)


def _mla_attention(model, li: int, attn, x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """DeepSeek's multi-head latent attention, keys and values expanded per head."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    N, H = x.shape[0], attn.num_heads
    nope, rope, dv = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    if attn.q_lora_rank is None:
        q = ops.linear(x, attn.q_proj.weight)
    else:
        q = ops.linear(
            _norm(attn.q_a_layernorm, ops.linear(x, attn.q_a_proj.weight, attn.q_a_proj.bias)), attn.q_b_proj.weight
        )
    q_pass, q_rot = q.view(N, H, nope + rope).split([nope, rope], dim=-1)
    ckv = ops.linear(x, attn.kv_a_proj_with_mqa.weight, attn.kv_a_proj_with_mqa.bias)
    kv_nope, k_rot = ckv.split([attn.kv_lora_rank, rope], dim=-1)
    cos, sin = rope_tables(model, int(rows.positions.max()) + 1)
    cos, sin = cos[rows.positions][None], sin[rows.positions][None]
    rotate = hf.apply_rotary_pos_emb_interleave if model.config.rope_interleave else hf.apply_rotary_pos_emb
    q_rot, k_rot = rotate(q_rot.transpose(0, 1)[None], k_rot.reshape(1, 1, N, rope), cos, sin)
    q = torch.cat([q_pass, q_rot[0].transpose(0, 1)], dim=-1)
    kv = ops.linear(_norm(attn.kv_a_layernorm, kv_nope), attn.kv_b_proj.weight).view(N, H, nope + dv)
    k_nope, v = kv.split([nope, dv], dim=-1)
    k = torch.cat([k_nope, k_rot[0, 0][:, None, :].expand(N, H, rope)], dim=-1)
    out = rows.attend(li, q, k, v, attn.scaling)
    return ops.linear(out.reshape(N, -1), attn.o_proj.weight, attn.o_proj.bias)


def dense_mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    """A gate/up/down silu MLP (dense layers, shared experts)."""
    gate, up = ops.linear(x, mlp.gate_proj.weight), ops.linear(x, mlp.up_proj.weight)
    return ops.linear(ops.silu_mul(gate, up), mlp.down_proj.weight)


def layer(model, li: int, h: torch.Tensor, rows: Rows, mlp_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Decoder layer li on rows h [N, D] (fp32): attention, then the MLP; its router sees every row.
    With mlp_rows only those rows go on (their new h, [len(mlp_rows), D]): nothing else reads them."""
    lay = model.model.layers[li]
    attention = _mla_attention if model.config.model_type == "deepseek_v3" else _gqa_attention
    h = h + attention(model, li, lay.self_attn, _norm(lay.input_layernorm, h), rows)
    x = _norm(lay.post_attention_layernorm, h)
    mlp = lay.mlp
    if not hasattr(mlp, "experts"):
        return h + dense_mlp(mlp, x) if mlp_rows is None else h[mlp_rows] + dense_mlp(mlp, x[mlp_rows])
    weights, ids = rows.route(mlp, x)
    if mlp_rows is not None:
        h, x, weights, ids = h[mlp_rows], x[mlp_rows], weights[mlp_rows], ids[mlp_rows]
    out = ops.experts(mlp.experts, x, ids, weights)
    if hasattr(mlp, "shared_experts"):
        out = out + dense_mlp(mlp.shared_experts, x)
    return h + out


def embed(model, tokens: torch.Tensor) -> torch.Tensor:
    return model.model.embed_tokens(tokens).float()


def final_norm(model, h: torch.Tensor) -> torch.Tensor:
    return _norm(model.model.norm, h)


def head(model, h: torch.Tensor) -> torch.Tensor:
    """Logits [N, vocab] fp32 of final hidden rows h [N, D]."""
    return ops.linear(h, model.lm_head.weight)


# -- the trainer's forward -----------------------------------------------------------------------


def sequence_forward(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The decoder over whole sequences input_ids [B, T] (right-padded): final hidden states
    [B, T, D] fp32, differentiable; MoE layers route through their gate modules."""
    B, T = input_ids.shape
    positions = torch.arange(T).repeat(B)

    def attend(li, q, k, v, scale):
        return ops.sequence_attention(q, k, v, B, T, scale)

    rows = Rows(positions, attend, _through_gate_module)
    h = embed(model, input_ids.reshape(-1))
    for li in range(len(model.model.layers)):
        h = layer(model, li, h, rows)
    return final_norm(model, h).view(B, T, -1)


def _decoder_forward(
    model,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    cache=None,
    inputs_embeds=None,
    use_cache=None,
    output_router_logits=None,
    **kwargs,
):
    """`model.model.forward` under `deterministic_mode`: `sequence_forward` behind the HF decoder's
    signature, refusing what it does not compute."""
    from transformers.modeling_outputs import MoeModelOutputWithPast

    if input_ids is None or inputs_embeds is not None:
        raise ValueError("deterministic mode takes input_ids")
    asked = sorted(k for k, v in kwargs.items() if v is not None)  # transformers 5.19 passes some as None
    if cache is not None or use_cache or output_router_logits or asked:
        raise ValueError(
            f"deterministic mode computes no KV cache, router logits or {', '.join(asked) or 'other outputs'}"
        )
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("deterministic mode takes unpadded or right-padded batches without an attention mask")
    T = input_ids.shape[1]
    if position_ids is not None and not torch.equal(position_ids.reshape(-1, T)[0], torch.arange(T)):
        raise ValueError("deterministic mode computes positions 0..T-1")
    return MoeModelOutputWithPast(last_hidden_state=sequence_forward(model, input_ids))


@contextmanager
def deterministic_mode(model):
    """Run a Hugging Face policy's forward (decoder, output head, MoE gates) on the batch-invariant
    forward above, with gradients. Only this model's modules change (their `forward` attributes),
    for the duration of the context: another thread running this model object meanwhile runs it
    too."""
    check_supported(model)
    decoder, lm_head, gates = model.model, model.lm_head, [b.gate for b in moe_blocks(model)]
    assert "forward" not in decoder.__dict__, "deterministic_mode is already active on this model"
    decoder.forward = lambda *args, **kw: _decoder_forward(model, *args, **kw)
    lm_head.forward = lambda x: head(model, x)
    for gate in gates:
        gate.forward = lambda x, gate=gate: gate_route(gate, x.reshape(-1, x.shape[-1]))
        gate.route_at = lambda x, ids, gate=gate: gate_route_at(gate, x, ids)
    try:
        yield model
    finally:
        del decoder.forward, lm_head.forward
        for gate in gates:
            del gate.forward, gate.route_at
