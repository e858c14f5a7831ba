"""The batch-invariant ops a model's forward is built from, on the C kernels (`strop.kernels`), and
differentiable: the values are the kernels', the gradients torch's.

A row's value never depends on the other rows of a call (see `strop.kernels`), so the engine, one
row at a time or beside hundreds, and the trainer, whole sequences at once, compute the same bits.
For training, each op is a `torch.autograd.Function` whose forward calls the kernel and whose
backward is torch arithmetic of the same math: closed-form for the heavy ops (linear: two
matmuls; attention: ATen's flash-attention backward fed the kernel's output and log-sum-exp;
experts: grouped matmuls over what the forward saved; silu: a C kernel), and for the cheap
row-wise ones (norms, rotation, router weights) the gradient of a torch reference recomputed in
the backward. The gradients differ from autograd through torch's own forward only in rounding.
Without gradients an op is the bare kernel call.

Activations are fp32 whatever the weights' dtype (fp32, or bf16 widened exactly). Packed copies
of weights are kept between forwards until the weight changes in place through torch (its version
counter moves), is freed, or `forget_packs` runs (after writes that bypass torch: numpy or C views
of a tensor's memory, as the weight-sync patcher makes). A weight update that knows which tensors
it changes keeps the rest: `repack` rebuilds the kept packs that read those tensors from their new
values (while the old ones still serve), and `install_packs` swaps them in once the new values are
written.
"""

import weakref
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from strop import kernels


@dataclass(frozen=True)
class _Kept:
    """A packed copy built from `sources` (weak references) at their `versions`, and how to rebuild it."""

    sources: tuple[weakref.ref, ...]
    versions: tuple[int, ...]
    build: Callable
    out: object


_packs: dict[tuple[int, str], _Kept] = {}  # (id(first source), kind) -> its kept pack


def forget_packs() -> None:
    """Drop every kept packed weight (call after writing weights through numpy or C views)."""
    _packs.clear()


def _kept(sources: tuple[torch.Tensor, ...], kind: str, build: Callable):
    """build(*sources, detached), kept under (id(sources[0]), kind) while every source's version holds."""
    w = sources[0]
    key, versions = (id(w), kind), tuple(t._version for t in sources)
    hit = _packs.get(key)
    if hit is not None and hit.sources[0]() is w and hit.versions == versions:
        return hit.out
    if hit is None or hit.sources[0]() is not w:
        weakref.finalize(w, _packs.pop, key, None)
    with torch.no_grad():
        out = build(*(t.detach() for t in sources))
    _packs[key] = _Kept(tuple(weakref.ref(t) for t in sources), versions, build, out)
    return out


def _reads(kept: _Kept, tensors: Collection[int]) -> bool:
    return any(id(ref()) in tensors for ref in kept.sources)


def repack(changed: Collection[int], new: Mapping[int, torch.Tensor]) -> dict[tuple[int, str], object]:
    """The kept packs that read any of the tensors `changed` (ids), rebuilt from their new values
    (`new`, by id of the tensor they will be written into; a tensor's own value where absent) and
    the other sources as they are. Changes nothing kept: the old packs serve until `install_packs`
    (so this can run beside a forward)."""
    out = {}
    with torch.no_grad():
        for key, kept in list(_packs.items()):
            sources = [ref() for ref in kept.sources]
            if any(t is None for t in sources) or not any(id(t) in changed for t in sources):
                continue
            out[key] = kept.build(*(new.get(id(t), t).detach() for t in sources))
    return out


def install_packs(repacked: Mapping[tuple[int, str], object], changed: Collection[int]) -> None:
    """After the tensors `changed` (ids) were written: keep the `repack`ed packs at the sources'
    versions now, and drop any other kept pack that reads a changed tensor."""
    for key, kept in list(_packs.items()):
        if not _reads(kept, changed):
            continue
        sources = [ref() for ref in kept.sources]
        if key in repacked and all(t is not None for t in sources):
            versions = tuple(t._version for t in sources)
            _packs[key] = _Kept(kept.sources, versions, kept.build, repacked[key])
        else:
            _packs.pop(key, None)


def packed(weight: torch.Tensor) -> kernels.Packed:
    """`weight` [n, m] packed for the matrix kernels (kept between calls)."""
    return _kept((weight,), "linear", kernels.pack_linear)


def fp32(t: torch.Tensor) -> torch.Tensor:
    """A norm weight or bias as the kernels read it: fp32, contiguous (kept between calls)."""
    if t.dtype == torch.float32 and t.is_contiguous():
        return t.detach()
    return _kept((t,), "fp32", lambda w: w.float().contiguous())


def _grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# -- linear ------------------------------------------------------------------------------------------


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return kernels.linear(x, packed(weight), None if bias is None else fp32(bias))

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx = g @ weight.to(g.dtype) if ctx.needs_input_grad[0] else None
        gw = (g.t() @ x).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = g.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., m] (fp32) @ weight [n, m].T (+ bias): [..., n] fp32."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if _grad(x, weight, bias):
        out = _Linear.apply(x2, weight, bias)
    else:
        out = kernels.linear(x2, packed(weight), None if bias is None else fp32(bias))
    return out.reshape(*lead, out.shape[-1])


# -- row-wise ops: kernel values, gradients of a torch reference -------------------------------------


class _ReferenceGrad(torch.autograd.Function):
    """forward(kernel, reference, *inputs) = kernel(*inputs); backward = the gradient of
    reference(*inputs), a torch version of the same math recomputed here (cheap row-wise ops)."""

    @staticmethod
    def forward(ctx, kernel, reference, *inputs):
        ctx.reference = reference
        ctx.save_for_backward(*inputs)
        return kernel(*inputs)

    @staticmethod
    def backward(ctx, g):
        need = ctx.needs_input_grad[2:]
        inputs = [t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, need)]
        with torch.enable_grad():
            out = ctx.reference(*inputs)
        wanted = [t for t, n in zip(inputs, need) if n]
        grads = iter(torch.autograd.grad(out, wanted, g, allow_unused=True))
        return (None, None, *(next(grads) if n else None for n in need))


def _row_op(kernel: Callable, reference: Callable, *inputs: torch.Tensor) -> torch.Tensor:
    if _grad(*inputs):
        return _ReferenceGrad.apply(kernel, reference, *inputs)
    return kernel(*inputs)


def _rms_ref(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of rows x [N, D] times weight [D]: [N, D] fp32."""
    return _row_op(lambda x, w: kernels.rms_norm(x, fp32(w), eps), lambda x, w: _rms_ref(x, w, eps), x, weight)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return kernels.silu_mul(g, u)

    @staticmethod
    def backward(ctx, d_act):
        g, u = ctx.saved_tensors
        grads = kernels.silu_mul_backward(g, u, d_act)
        return grads[:, : g.shape[1]], grads[:, g.shape[1] :]


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for [N, I] rows."""
    return _SiluMul.apply(g, u) if _grad(g, u) else kernels.silu_mul(g, u)


def qk_norm_rope(
    qk: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    rope: tuple[torch.Tensor, torch.Tensor],
    positions: torch.Tensor,
    n_q: int,
) -> torch.Tensor:
    """Per-head RMSNorm (weight [heads, d]) then rotary rotation of rows qk [N, heads * d] (q heads
    first) by position; rope = (cos, sin) tables [P, d], sin carrying the rotate-half sign."""
    cos, sin = rope
    heads, d = weight.shape

    def reference(x, w):
        y = _rms_ref(x.view(-1, heads, d), w, eps)
        return y * cos[positions][:, None] + y.roll(d // 2, -1) * sin[positions][:, None]

    return _row_op(lambda x, w: kernels.qk_norm_rope(x, fp32(w), cos, sin, positions, n_q, eps), reference, qk, weight)


def rope(qk: torch.Tensor, heads: int, tables: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor):
    """`qk_norm_rope` without the norm (Llama): the rotation of rows qk [N, heads * d] by position."""
    cos, sin = tables
    d = qk.shape[1] // heads

    def reference(x):
        y = x.view(-1, heads, d)
        return y * cos[positions][:, None] + y.roll(d // 2, -1) * sin[positions][:, None]

    return _row_op(lambda x: kernels.qk_norm_rope(x, None, cos, sin, positions, 0, 0.0, heads), reference, qk)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """`torch.sigmoid` whose value for an element never depends on the tensor's size or layout:
    1 / (1 + exp(-x)), in fp32. ATen's sigmoid rounds differently in its loops' vectorized body and
    scalar remainder, so a row's value changed with the number of rows beside it (a DeepSeek
    router's weights differed between engine decode and trainer on AVX-512); `exp`'s kernel runs
    the remainder through the vector code too. The exponent is capped at 88 (exp(88) is finite),
    so gradients stay finite far below -88."""
    return 1 / (1 + torch.exp(-x.float().clamp(min=-88.0)))


# -- routing --------------------------------------------------------------------------------------


def _softmax_weights_ref(logits, ids, n_experts, norm):
    w = torch.softmax(logits[:, :n_experts], dim=-1).gather(1, ids)
    return w / w.sum(-1, keepdim=True) if norm else w


def route_softmax(logits: torch.Tensor, n_experts: int, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A softmax router's top-k from logits [N, >= n_experts] (padding columns ignored): (weights
    [N, k] fp32, ids [N, k] int64), largest first, ties to the lower id."""
    if not _grad(logits):
        return kernels.route_softmax(logits, n_experts, k, norm)
    ids = kernels.route_softmax(logits.detach(), n_experts, k, norm)[1]
    return route_softmax_at(logits, n_experts, ids, norm), ids


def route_softmax_at(logits: torch.Tensor, n_experts: int, ids: torch.Tensor, norm: bool) -> torch.Tensor:
    """`route_softmax`'s weights for given expert ids [N, k] (router replay, R3)."""
    ids = ids.long()
    return _row_op(
        lambda lg: kernels.route_softmax_at(lg, n_experts, ids, norm),
        lambda lg: _softmax_weights_ref(lg, ids, n_experts, norm),
        logits,
    )


# -- attention ------------------------------------------------------------------------------------


def _sequence_caches(k: torch.Tensor, v: torch.Tensor, B: int, T: int) -> list[torch.Tensor]:
    """Key and value rows [B * T, nk, d] laid out as B cache slots [B, nk, T, d]."""
    return [t.reshape(B, T, *t.shape[1:]).transpose(1, 2).contiguous() for t in (k, v)]


class _SequenceAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, B, T, scale):
        caches = _sequence_caches(k, v, B, T)
        rows = torch.arange(B * T)
        out, lse = kernels.attention(q, *caches, rows // T, rows % T, scale, with_lse=True)
        ctx.save_for_backward(q, *caches, out, lse)
        ctx.shape = (B, T, scale)
        return out

    @staticmethod
    def backward(ctx, g):
        """ATen's CPU flash-attention backward, fed the kernel's output and log-sum-exp (it
        recomputes the probabilities from them); grouped query heads' key gradients add up. It
        takes one head width, so key and value widths that differ are zero-padded to the larger
        (zero columns add nothing to scores or outputs)."""
        q, kc, vc, out, lse = ctx.saved_tensors
        B, T, scale = ctx.shape
        nq, nk, dk, dv = q.shape[1], kc.shape[1], q.shape[2], vc.shape[3]
        d = max(dk, dv)

        def heads(t):  # [B * T, nq, w] rows -> [B, nq, T, d] (zero-padded to d)
            return F.pad(t.view(B, T, nq, -1).transpose(1, 2), (0, d - t.shape[-1]))

        k, v = (F.pad(c.repeat_interleave(nq // nk, 1), (0, d - c.shape[-1])) for c in (kc, vc))
        dq, dk_, dv_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            heads(g.contiguous()),
            heads(q),
            k,
            v,
            heads(out),
            lse.view(B, T, nq).transpose(1, 2),
            0.0,
            True,
            scale=scale,
        )

        def rows(t, w):  # [B, nq, T, d] -> [B * T, nk, w], grouped heads summed
            return t[..., :w].reshape(B, nk, nq // nk, T, w).sum(2).transpose(1, 2).reshape(B * T, nk, w)

        return dq[..., :dk].transpose(1, 2).reshape(B * T, nq, dk), rows(dk_, dk), rows(dv_, dv), None, None, None


def sequence_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, length: int, scale: float
) -> torch.Tensor:
    """Causal attention within `batch` sequences of `length` rows each (row b * length + t is
    position t of sequence b): q [N, nq, dk], k [N, nk, dk], v [N, nk, dv] -> [N, nq, dv]. Each query
    is computed as an engine computes it over its KV cache."""
    if _grad(q, k, v):
        return _SequenceAttention.apply(q.contiguous(), k, v, batch, length, scale)
    rows = torch.arange(batch * length)
    return kernels.attention(
        q.contiguous(), *_sequence_caches(k, v, batch, length), rows // length, rows % length, scale
    )


# -- experts --------------------------------------------------------------------------------------


def packed_experts(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """An HF experts module's projections packed for `kernels.moe_experts` (kept between calls)."""
    return _kept((experts.gate_up_proj, experts.down_proj), "experts", kernels.pack_experts)


class _Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, gate_up_proj, down_proj, ids, packs):
        out, order, gu, y = kernels.moe_experts(x, ids, weights, *packs, save=True)
        ctx.save_for_backward(x, weights, gate_up_proj, down_proj, ids, order, gu, y)
        return out

    @staticmethod
    def backward(ctx, g):
        """Through the expert-sorted assignments the forward saved, with grouped matmuls:
        d weights[n, k] = <dOut[n], y[n, k]>, dY = weights dOut, dW_down = dY^T act, d act = dY W_down,
        silu's derivative (in C), dW_gate_up = dGU^T x, dx = dGU W_gate_up summed over each token's
        experts."""
        x, weights, gate_up_proj, down_proj, ids, order, gu, y = ctx.saved_tensors
        N, K = ids.shape
        E, H, I = down_proj.shape
        offs = torch.cumsum(torch.bincount(ids.reshape(-1), minlength=E), 0, dtype=torch.int32)
        token = order // K
        gw = torch.bmm(y.view(N, K, H), g[:, :, None])[..., 0]
        gy = g.index_select(0, token) * weights.float().reshape(-1).index_select(0, order)[:, None]
        g_act = F.grouped_mm(gy, down_proj.float(), offs=offs)
        g_gu, act = kernels.silu_mul_backward(gu[:, :I], gu[:, I:], g_act, with_act=True)
        g_down = F.grouped_mm(gy.t(), act, offs=offs)
        g_x = torch.zeros_like(x).index_add_(0, token, F.grouped_mm(g_gu, gate_up_proj.float(), offs=offs))
        g_gate_up = F.grouped_mm(g_gu.t(), x.index_select(0, token), offs=offs)
        return g_x, gw.to(weights.dtype), g_gate_up.to(gate_up_proj.dtype), g_down.to(down_proj.dtype), None, None


def experts(module, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """An HF experts module (gate_up_proj [E, 2I, H], down_proj [E, H, I], silu) on rows x [N, H]
    routed to ids [N, k] with gate weights [N, k]: the gate-weighted sum of each row's expert
    outputs, added to zero in k order."""
    packs = packed_experts(module)
    if _grad(x, weights, module.gate_up_proj, module.down_proj):
        return _Experts.apply(x, weights, module.gate_up_proj, module.down_proj, ids.long(), packs)
    return kernels.moe_experts(x, ids, weights, *packs)
