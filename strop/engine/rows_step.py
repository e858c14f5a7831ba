"""A whole forward pass of a softmax-routed MoE model as one C call (`forward_rows` in
`strop.kernels.csrc_step`), for any rows: a decode step, prompts, prompt suffixes after reused keys.

Why: kernel by kernel, a decode step of the demo model made four ctypes calls and a few torch ops
per layer, each paying microseconds of argument conversion and tensor plumbing (~15% of a step at
batch 16). Here every weight the step reads is resolved to a pointer once, when the forward
refreshes its derived weights, and a call passes only its tokens, slots, positions and output
rows. It chains the kernels `strop.model.deterministic` calls one by one, so its numbers are
theirs bit for bit (tested).
"""

from dataclasses import dataclass

import torch

from strop import kernels
from strop.model import deterministic as det
from strop.model import kernel_ops


@dataclass
class Layer:
    """What one decoder layer reads; its MLP is a softmax-routed MoE without shared experts."""

    norms: tuple  # (input weight, eps, post weight, eps, q/k weight [nq + nk, d], eps), fp32
    qkv: tuple  # (fused q/k/v weight [(nq + 2 nk) d, D], fused bias or None)
    o: tuple  # (weight [D, nq d], bias or None)
    scale: float
    caches: tuple  # (k, v) [S, nk, L, d] fp32
    router: torch.Tensor  # [E, D]
    top_k: int
    norm_topk: bool
    experts: object  # the HF experts module


def step_layers(model, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]) -> list[Layer] | None:
    """The layers of `model` as the C step reads them, or None when it cannot run this model: only
    qwen3_moe with every layer MoE, widths that are multiples of 32 (hidden, fused q/k/v) and head
    widths that are multiples of 8."""
    if model.config.model_type != "qwen3_moe" or model.config.hidden_size % 32:
        return None
    layers = []
    for li, lay in enumerate(model.model.layers):
        a, mlp = lay.self_attn, lay.mlp
        if not hasattr(mlp, "experts") or a.head_dim % 8:
            return None
        projs = (a.q_proj, a.k_proj, a.v_proj)
        w = torch.cat([p.weight.detach() for p in projs])
        if w.shape[0] % 32:
            return None
        b = torch.cat([p.bias.detach() for p in projs]).float() if a.q_proj.bias is not None else None
        nq, nk = a.q_proj.weight.shape[0] // a.head_dim, a.k_proj.weight.shape[0] // a.head_dim
        qk = torch.cat([a.q_norm.weight.detach().expand(nq, -1), a.k_norm.weight.detach().expand(nk, -1)]).float()
        norm, post = lay.input_layernorm, lay.post_attention_layernorm
        norms = (kernel_ops.fp32(norm.weight), norm.variance_epsilon, kernel_ops.fp32(post.weight),
                 post.variance_epsilon, qk, a.q_norm.variance_epsilon)
        o_bias = None if a.o_proj.bias is None else kernel_ops.fp32(a.o_proj.bias)
        layers.append(Layer(norms, (w, b), (a.o_proj.weight.detach(), o_bias), a.scaling, (k_cache[li], v_cache[li]),
                            mlp.gate.weight.detach(), mlp.gate.top_k, mlp.gate.norm_topk_prob, mlp.experts))
    return layers


class RowsStep:
    """step(tokens, slots, positions, out_rows) -> (logits [S, V] of the rows out_rows, expert ids
    [N, layers, K] int64) for N token rows (int64 tensors [N]; out_rows [S]).

    Packs the weights when built (bf16 when every one of them holds bf16 values, else fp32: the
    same results either way) and holds every tensor it points into: build a new one after any
    weight changes."""

    def __init__(self, model, layers: list[Layer]):
        first = layers[0]
        _, nk, L, d = first.caches[0].shape
        D, E, K = model.config.hidden_size, first.router.shape[0], first.top_k
        weights = [w for lay in layers for w in (lay.qkv[0], lay.o[0], lay.router, lay.experts.gate_up_proj,
                                                  lay.experts.down_proj)] + [model.lm_head.weight]
        bf16 = all(kernels.is_bf16_exact(w) for w in weights)
        held = []
        for lay in layers:
            qkv, o, router = (kernels.pack_linear(w, bf16).data for w in (lay.qkv[0], lay.o[0], lay.router))
            experts = kernels.pack_experts(lay.experts.gate_up_proj, lay.experts.down_proj)
            experts = tuple(t.to(qkv.dtype) for t in experts)  # one storage for all: widening bf16 is exact
            held += [lay.norms[0], qkv, lay.qkv[1], lay.norms[4], o, lay.o[1], lay.norms[2], *lay.caches, router,
                     *experts]
        head = kernels.pack_linear(model.lm_head.weight, bf16)
        cos, sin = det.rotate_half_tables(model, L)
        held += [kernel_ops.fp32(model.model.embed_tokens.weight), cos.contiguous(), sin.contiguous(),
                 kernel_ops.fp32(model.model.norm.weight), head.data]
        self._held = held  # keeps every pointed-to tensor alive
        self._ptrs = torch.tensor([0 if t is None else t.data_ptr() for t in held], dtype=torch.int64)
        vals = [v for lay in layers for v in (lay.norms[1], lay.norms[5], lay.norms[3], lay.scale)]
        self._vals = torch.tensor(vals + [model.model.norm.variance_epsilon], dtype=torch.float32)
        e_packed = -(-E // 32) * 32
        cfg = [len(layers), D, first.o[0].shape[1] // d, nk, d, L, E, e_packed, K, int(first.norm_topk),
               first.experts.down_proj.shape[2], int(bf16), head.data.shape[0] * 32]
        self._cfg = torch.tensor(cfg, dtype=torch.int64)
        self.vocab, self._width = head.n, cfg[-1]
        self.routing_shape = (len(layers), K)
        self._fn, self._sizes = kernels.function("forward_rows"), kernels.function("forward_rows_scratch")
        self._fixed = (self._cfg.data_ptr(), self._ptrs.data_ptr(), self._vals.data_ptr())
        self._fs, self._is = torch.empty(0), torch.empty(0, dtype=torch.int64)

    def __call__(self, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                 out_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        N, S = tokens.shape[0], out_rows.shape[0]
        assert tokens.dtype == slots.dtype == positions.dtype == out_rows.dtype == torch.int64
        sizes = torch.empty(2, dtype=torch.int64)
        self._sizes(self._cfg.data_ptr(), N, S, sizes.data_ptr())
        if self._fs.numel() < sizes[0]:
            self._fs = torch.empty(int(sizes[0]))
        if self._is.numel() < sizes[1]:
            self._is = torch.empty(int(sizes[1]), dtype=torch.int64)
        out, ids = torch.empty(S, self._width), torch.empty(N, *self.routing_shape, dtype=torch.int64)
        self._fn(tokens.data_ptr(), slots.data_ptr(), positions.data_ptr(), N, out_rows.data_ptr(), S, *self._fixed,
                 out.data_ptr(), ids.data_ptr(), self._fs.data_ptr(), self._is.data_ptr())
        return (out if self._width == self.vocab else out[:, : self.vocab]), ids
