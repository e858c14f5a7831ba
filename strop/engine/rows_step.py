"""A whole forward pass of a softmax-routed MoE model or a dense one (Llama, Qwen3) as one C call
(`forward_rows` in `strop/kernels/step.c`), for any rows: a decode step, prompts, prompt suffixes
after reused keys.

Why: kernel by kernel, a decode step of the demo model made four ctypes calls and a few torch ops
per layer, each paying microseconds of argument conversion and tensor plumbing (~15% of a step at
batch 16; a dense 30-layer model such as SmolLM2 makes ten per layer). Here every weight the step
reads is resolved to a pointer once, when the forward refreshes its derived weights, and a call
passes only its tokens, slots, positions and output rows. It chains the kernels
`strop.model.deterministic` calls one by one, so its numbers are theirs bit for bit (tested).

The packed weights (`StepPacks`, built by `pack`) are separate from the call (`RowsStep`, a pointer
table over them, cheap to build): a weight update packs again only the layers whose tensors it
changes, from their new values, while the old step keeps running, and the engine builds the new
step over old and new packs at the swap.
"""

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from strop import kernels
from strop.model import deterministic as det


@dataclass(frozen=True)
class LayerPacks:
    """What the C step reads of one decoder layer (a softmax-routed MoE without shared experts, or
    a dense silu MLP), derived from its weights, in the step's pointer order: (input norm, fused
    q/k/v, its bias or None, q/k norm [nq + nk, d] or None (Llama), o, o bias or None, post norm,
    router (None: dense), gate_up (experts packed, or a dense MLP's gate and up as one packed
    linear), down); norms and biases fp32, the matrices packed in one dtype."""

    tensors: tuple
    vals: tuple  # (input norm eps, q/k norm eps, post norm eps, attention scale)


@dataclass(frozen=True)
class StepPacks:
    """Every weight the step reads, packed: bf16 when every matrix holds bf16 values, else fp32 (the
    same results either way)."""

    layers: list[LayerPacks]
    head: kernels.Packed
    model_tensors: tuple  # (embeddings fp32, rotate-half cos and sin tables, final norm fp32)
    exact: dict[int, bool]  # id of each matrix -> whether it holds only bf16 values
    bf16: bool


def _dense(model) -> bool:
    return model.config.model_type in ("qwen3", "llama")


def fits(model) -> bool:
    """Whether the C step runs this model: qwen3_moe with every layer MoE, or a dense qwen3 or llama
    (MLPs without biases, intermediate width a multiple of 16); widths that are multiples of 32
    (hidden, fused q/k/v) and head widths that are multiples of 8."""
    cfg = model.config
    if cfg.model_type not in ("qwen3_moe", "qwen3", "llama") or cfg.hidden_size % 32:
        return False
    for lay in model.model.layers:
        a, mlp = lay.self_attn, lay.mlp
        width = sum(p.weight.shape[0] for p in (a.q_proj, a.k_proj, a.v_proj))
        if a.head_dim % 8 or width % 32:
            return False
        if _dense(model):
            if hasattr(mlp, "experts") or mlp.gate_proj.bias is not None or mlp.gate_proj.weight.shape[0] % 16:
                return False
        elif not hasattr(mlp, "experts"):
            return False
    return True


def _matrices(lay) -> list[torch.Tensor]:
    a, mlp = lay.self_attn, lay.mlp
    attention = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight]
    if not hasattr(mlp, "experts"):
        return attention + [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    return attention + [mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj]


def _fp32(live: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A norm weight or bias as the step reads it: the live tensor itself when it is fp32 (an update
    writes it in place), else an fp32 copy of its value."""
    if live.dtype == torch.float32 and live.is_contiguous():
        return live.detach()
    return value.detach().float().contiguous()


def _pack_layer(lay, bf16: bool, get) -> LayerPacks:
    a, mlp = lay.self_attn, lay.mlp
    projs = (a.q_proj, a.k_proj, a.v_proj)
    qkv = kernels.pack_linear(torch.cat([get(p.weight) for p in projs]), bf16).data
    qkv_bias = torch.cat([get(p.bias) for p in projs]).float() if a.q_proj.bias is not None else None
    nq, nk = a.q_proj.weight.shape[0] // a.head_dim, a.k_proj.weight.shape[0] // a.head_dim
    qk = None
    if hasattr(a, "q_norm"):  # Qwen3's per-head q/k norm; Llama has none
        qk = torch.cat([get(a.q_norm.weight).expand(nq, -1), get(a.k_norm.weight).expand(nk, -1)]).float()
    o = kernels.pack_linear(get(a.o_proj.weight), bf16).data
    o_bias = None if a.o_proj.bias is None else _fp32(a.o_proj.bias, get(a.o_proj.bias))
    if hasattr(mlp, "experts"):
        router = kernels.pack_linear(get(mlp.gate.weight), bf16).data
        experts = kernels.pack_experts(get(mlp.experts.gate_up_proj), get(mlp.experts.down_proj))
        gate_up, down = (t.to(qkv.dtype) for t in experts)  # one dtype for all: widening bf16 is exact
    else:  # gate and up as one linear: each output column is summed alone, so fusing changes no bit
        router = None
        gate_up = kernels.pack_linear(torch.cat([get(mlp.gate_proj.weight), get(mlp.up_proj.weight)]), bf16).data
        down = kernels.pack_linear(get(mlp.down_proj.weight), bf16).data
    norm, post = lay.input_layernorm, lay.post_attention_layernorm
    tensors = (
        _fp32(norm.weight, get(norm.weight)),
        qkv,
        qkv_bias,
        qk,
        o,
        o_bias,
        _fp32(post.weight, get(post.weight)),
        router,
        gate_up,
        down,
    )
    eps_qk = a.q_norm.variance_epsilon if qk is not None else 0.0
    return LayerPacks(tensors, (norm.variance_epsilon, eps_qk, post.variance_epsilon, a.scaling))


def reads(module, changed: Collection[int] | None) -> bool:
    """Whether `module` reads any of the tensors `changed` (ids; None: every tensor changed)."""
    return changed is None or any(id(t) in changed for t in (*module.parameters(), *module.buffers()))


@torch.no_grad()
def pack(
    model,
    max_len: int,
    changed: Collection[int] | None = None,
    new: Mapping[int, torch.Tensor] | None = None,
    old: StepPacks | None = None,
) -> StepPacks:
    """The step's packs for `model` (`fits(model)`). With `old` and `changed` (ids of the tensors that
    change, taking the values `new` by id, or their own when absent): only the layers and the head
    reading a changed tensor are packed again (every one when the packed dtype changes), the rest
    are old's. Reads the model without changing it, so it can run while the old step serves."""
    new = new or {}

    def get(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else new.get(id(t), t).detach()

    layers, head = model.model.layers, model.lm_head.weight
    every = [w for lay in layers for w in _matrices(lay)] + [head]
    if old is None or changed is None:
        exact = {id(w): kernels.is_bf16_exact(w) for w in every}
    else:
        exact = {**old.exact, **{id(w): kernels.is_bf16_exact(get(w)) for w in every if id(w) in changed}}
    bf16 = all(exact.values())
    if old is None or changed is None or bf16 != old.bf16:
        cos, sin = det.rotate_half_tables(model, max_len)
        old, changed = None, None
    embed, norm = model.model.embed_tokens.weight, model.model.norm.weight
    if old is not None:
        cos, sin = old.model_tensors[1:3]
    model_tensors = (_fp32(embed, get(embed)), cos.contiguous(), sin.contiguous(), _fp32(norm, get(norm)))
    return StepPacks(
        [
            old.layers[li] if old is not None and not reads(lay, changed) else _pack_layer(lay, bf16, get)
            for li, lay in enumerate(layers)
        ],
        old.head if old is not None and id(head) not in changed else kernels.pack_linear(get(head), bf16),
        model_tensors,
        exact,
        bf16,
    )


class RowsStep:
    """step(tokens, slots, positions, out_rows) -> (logits [S, V] of the rows out_rows, expert ids
    [N, layers, K] int64) for N token rows (int64 arrays [N]; out_rows [S]). Its buffers are numpy
    arrays (the logits a tensor over one) and its scratch is sized by a call that keeps the GIL: a
    step gives up the GIL once, for the forward itself (see `strop.engine.sampling`).

    Points into `packs` and the KV caches (k_cache, v_cache: one [S, nk, L, d] fp32 tensor per
    layer) and holds them: build a new one after any weight changes."""

    def __init__(self, model, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], packs: StepPacks):
        first = model.model.layers[0]
        _, nk, L, d = k_cache[0].shape
        mlp = first.mlp
        dense = not hasattr(mlp, "experts")
        D = model.config.hidden_size
        E, K = (0, 0) if dense else (mlp.gate.weight.shape[0], mlp.gate.top_k)
        inter = mlp.down_proj.weight.shape[1] if dense else mlp.experts.down_proj.shape[2]
        held = []
        for lay, kc, vc in zip(packs.layers, k_cache, v_cache):
            held += [*lay.tensors[:7], kc, vc, *lay.tensors[7:]]
        held += [*packs.model_tensors, packs.head.data]
        self._held = held  # keeps every pointed-to tensor alive
        self._ptrs = torch.tensor([0 if t is None else t.data_ptr() for t in held], dtype=torch.int64)
        vals = [v for lay in packs.layers for v in lay.vals]
        self._vals = torch.tensor(vals + [model.model.norm.variance_epsilon], dtype=torch.float32)
        e_packed = -(-E // 32) * 32
        cfg = [
            len(packs.layers),
            D,
            first.self_attn.o_proj.weight.shape[1] // d,
            nk,
            d,
            L,
            E,
            e_packed,
            K,
            0 if dense else int(mlp.gate.norm_topk_prob),
            inter,
            int(packs.bf16),
            packs.head.data.shape[0] * 32,
        ]
        self._cfg = torch.tensor(cfg, dtype=torch.int64)
        self.vocab, self._width = packs.head.n, cfg[-1]
        self.routing_shape = (len(packs.layers), K)
        self._fn, self._sizes = (
            kernels.function("forward_rows"),
            kernels.function("forward_rows_scratch", keep_gil=True),
        )
        self._fixed = (self._cfg.data_ptr(), self._ptrs.data_ptr(), self._vals.data_ptr())
        self._fs, self._is = np.empty(0, np.float32), np.empty(0, np.int64)  # scratch, grown as needed

    def __call__(
        self, tokens: np.ndarray, slots: np.ndarray, positions: np.ndarray, out_rows: np.ndarray
    ) -> tuple[torch.Tensor, np.ndarray]:
        N, S = tokens.shape[0], out_rows.shape[0]
        assert tokens.dtype == slots.dtype == positions.dtype == out_rows.dtype == np.int64
        sizes = np.empty(2, np.int64)
        self._sizes(self._cfg.data_ptr(), N, S, sizes.ctypes.data)
        if self._fs.size < sizes[0]:
            self._fs = np.empty(int(sizes[0]), np.float32)
        if self._is.size < sizes[1]:
            self._is = np.empty(int(sizes[1]), np.int64)
        out, ids = np.empty((S, self._width), np.float32), np.empty((N, *self.routing_shape), np.int64)
        self._fn(
            tokens.ctypes.data,
            slots.ctypes.data,
            positions.ctypes.data,
            N,
            out_rows.ctypes.data,
            S,
            *self._fixed,
            out.ctypes.data,
            ids.ctypes.data,
            self._fs.ctypes.data,
            self._is.ctypes.data,
        )
        return torch.from_numpy(out if self._width == self.vocab else out[:, : self.vocab]), ids
