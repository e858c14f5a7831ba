"""C kernels for the engine's CPU forward and sampling, built with the system C compiler and
called through ctypes (the source is `strop.engine.csrc`).

Why: on a small model a decode step is hundreds of tiny ops, each costing more in dispatch than
in arithmetic. At decode each expert sees one or two tokens, so `F.grouped_mm` (like `bmm`)
becomes 64 tiny GEMM calls per layer; a whole attention block is ~15 torch ops; top-p wants a
full sort. Here: one call per attention block at decode (or per decode step:
`strop.engine.decode_step`), one per MoE layer (assignments
bucketed by expert, each expert's weights streamed once for all its tokens, the gate-weighted sum
over k in k order like the Python path), fused residual+RMSNorm, and a radix-select top-p sampler.

They need fp32, silu experts, widths that are multiples of 32 and weights packed by
`pack_linear` / `pack_experts` (rebuilt by the engine after every weight update). Without a C
compiler (or with STROP_NO_KERNELS set), `available()` is False and callers use torch ops. The
shared object is cached under ~/.cache/strop keyed by the source and this CPU's flags (it is
built with -march=native), so a copy on another machine is never loaded.
"""

import ctypes
import subprocess
import threading

import torch

from strop.engine.csrc import SOURCE as _SOURCE
from strop.native import load_library

MOE_GROUP = 16  # csrc's MOE_GROUP: most rows of one expert per pass (sizes moe_experts' scratch)
_lib: ctypes.CDLL | None = None
_tried = False
_local = threading.local()  # per-thread scratch buffers: engines on different threads never share one


def _scratch(slot: str, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A reusable buffer of at least n elements for kernel-internal scratch (never returned to callers);
    a decode step would otherwise pay a dozen allocations."""
    bufs = _local.__dict__.setdefault("bufs", {})
    buf = bufs.get(slot)
    if buf is None or buf.numel() < n:
        buf = bufs[slot] = torch.empty(max(n, 1), dtype=dtype)
    return buf


def _build() -> ctypes.CDLL | None:
    lib = load_library("moe", _SOURCE)
    if lib is None:
        return None
    P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    for name, args in (("add_rmsnorm", [P] * 4 + [I64] * 2 + [F32]),
                       ("qk_rope_cache", [P] * 9 + [I64] * 5 + [F32]),
                       ("decode_attention", [P, I64] + [P] * 6 + [I64] * 5 + [F32]),
                       ("moe_experts", [P] * 5 + [I64] + [P] * 5 + [I64] * 5),
                       ("linear_bf16", [P, I64, P, P, I64, I64]),
                       ("sample_top_p", [P] * 6 + [I64] * 2),
                       ("softmax_rows", [P] * 2 + [I64] * 2),
                       ("decode_step_scratch", [P, I64, P]),
                       ("decode_step", [P] * 3 + [I64] + [P] * 7),
                       ("attn_decode_block", [P] * 3 + [F32] + [P] * 3 + [F32] + [P] * 9 + [F32] + [P] * 2 + [I64] * 6 + [F32])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, args
    return lib


def available() -> bool:
    """Whether the compiled kernel can be used (built on first call)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        try:
            _lib = _build()
        except (OSError, subprocess.SubprocessError):
            _lib = None
    return _lib is not None


def function(name: str) -> ctypes._CFuncPtr:
    """The kernel `name`, its ctypes signature set once in `_build`, for wrappers outside this module."""
    return getattr(_lib, name)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Row softmax of fp32 x [N, V]; its exp is within 2 ulp of expf (torch's is within 1)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _lib.softmax_rows(x.data_ptr(), out.data_ptr(), *x.shape)
    return out


def sample_top_p(probs: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [N], p[token] / kept mass [N]) for probability rows [N, V], top_p [N] and u [N] in (0, 1]."""
    N, V = probs.shape
    tok, ratio, scratch = torch.empty(N, dtype=torch.int64), torch.empty(N), _scratch("sample", V)
    _lib.sample_top_p(probs.data_ptr(), top_p.data_ptr(), u.data_ptr(), tok.data_ptr(), ratio.data_ptr(),
                      scratch.data_ptr(), N, V)
    return tok, ratio


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """An nn.Linear weight [n, m] (n % 32 == 0) in the blocked layout [n / 32, m, 32]."""
    n, m = weight.shape
    return weight.detach().t().reshape(m, n // 32, 32).permute(1, 0, 2).contiguous()


def attn_decode_block(h: torch.Tensor, pending: torch.Tensor | None, norms: tuple, qkv: tuple, rope: tuple,
                      slots: torch.Tensor, positions: torch.Tensor, caches: tuple, o: tuple,
                      scale: float) -> torch.Tensor:
    """One decode attention block for rows h [N, D] (updated in place: + pending, + attention).

    norms: (input weight, eps, post weight, eps, q/k weight [nq + nk, d], eps); qkv and o:
    (blocked weight, bias or None); rope: (cos, sin) tables; caches: (k, v) [S, nk, L, d].
    Returns the post-attention RMSNorm of h, the MLP's input."""
    N, D = h.shape
    kc, vc = caches
    _, nk, L, d = kc.shape
    nq = o[0].shape[1] // d
    out = torch.empty(N, D)
    scratch = _scratch("attn", N * (2 * D + 3 * (nq + nk) * d) + L)
    w_in, eps_in, w_post, eps_post, w_qk, eps_qk = norms
    _lib.attn_decode_block(h.data_ptr(), _ptr(pending), w_in.data_ptr(), eps_in, qkv[0].data_ptr(), _ptr(qkv[1]),
                           w_qk.data_ptr(), eps_qk, rope[0].data_ptr(), rope[1].data_ptr(), slots.data_ptr(),
                           positions.data_ptr(), kc.data_ptr(), vc.data_ptr(), o[0].data_ptr(), _ptr(o[1]),
                           w_post.data_ptr(), eps_post, out.data_ptr(), scratch.data_ptr(), N, D, nq, nk, d, L, scale)
    return out


def is_bf16_exact(w: torch.Tensor) -> bool:
    """Whether every fp32 value of w is a bf16 value (its low 16 bits are zero), as in an engine
    whose weights arrive from the trainer as bf16 snapshots."""
    return w.dtype == torch.float32 and not bool((w.detach().contiguous().view(torch.int32) & 0xFFFF).any())


def pack_experts(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF expert weights in the kernel's layout: each projection transposed to [E, in, out],
    then cut into 32-output column blocks [E, out / 32, in, 32] (see `vecmat`). Stored as bf16
    when both projections hold only bf16 values (lossless, and half the bytes each decode step
    streams through the cache), else fp32."""
    as_bf16 = is_bf16_exact(experts.gate_up_proj) and is_bf16_exact(experts.down_proj)

    def blocked(w: torch.Tensor) -> torch.Tensor:  # [E, out, in] -> [E, out / 32, in, 32]
        E, n_out, n_in = w.shape
        w = w.detach().to(torch.bfloat16) if as_bf16 else w.detach()
        return w.transpose(1, 2).reshape(E, n_in, n_out // 32, 32).permute(0, 2, 1, 3).contiguous()

    return blocked(experts.gate_up_proj), blocked(experts.down_proj)


def pack_head(weight: torch.Tensor) -> torch.Tensor | None:
    """The output head [vocab, hidden] for `head_logits`: blocked bf16, or None when its values are
    not all bf16 (the exact widening would not reproduce them) or vocab % 32 != 0."""
    if weight.shape[0] % 32 or not is_bf16_exact(weight):
        return None
    return pack_linear(weight).to(torch.bfloat16)


def head_logits(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [N, hidden] fp32 times the `pack_head` weight: logits [N, vocab]."""
    x = x.contiguous()
    N, m = x.shape
    n = packed.shape[0] * 32
    out = torch.empty(N, n)
    _lib.linear_bf16(x.data_ptr(), N, packed.data_ptr(), out.data_ptr(), m, n)
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def add_rmsnorm(h: torch.Tensor, a: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += a in place (a may be None), then RMSNorm(h) * weight as a new [N, D] tensor."""
    N, D = h.shape
    out = torch.empty_like(h)
    _lib.add_rmsnorm(h.data_ptr(), _ptr(a), weight.data_ptr(), out.data_ptr(), N, D, eps)
    return out


def qk_rope_cache(qkv: torch.Tensor, qk_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  slots: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  n_q: int, eps: float) -> torch.Tensor:
    """Per-head RMSNorm and rotation of q and k from the fused projection `qkv` [N, (nq + 2nk) d];
    k and v written into the caches [S, nk, L, d] at (slot, position). Returns qk [N, nq + nk, d]."""
    _, n_k, L, d = k_cache.shape
    N = qkv.shape[0]
    qk = torch.empty(N, n_q + n_k, d)
    _lib.qk_rope_cache(qkv.data_ptr(), qk_weight.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                       positions.data_ptr(), qk.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), N, n_q, n_k, d, L, eps)
    return qk


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, nq, d] (rows may be strided) against each row's cached keys 0..position: [N, nq, d]."""
    _, n_k, L, d = k_cache.shape
    N, n_q = q.shape[0], q.shape[1]
    assert q.stride(2) == 1 and q.stride(1) == d
    out = torch.empty(N, n_q, d)
    scores = _scratch("scores", L)
    _lib.decode_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                          positions.data_ptr(), out.data_ptr(), scores.data_ptr(), N, n_q, n_k, d, L, scale)
    return out


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """sum_k weights[n, k] * down(silu(gate) * up)(x[n]) through expert ids[n, k]: [N, H] fp32."""
    assert _lib is not None and x.dtype == torch.float32
    x, w = x.contiguous(), weights.float().contiguous()
    ids = ids.to(torch.int64).contiguous()
    N, K = ids.shape
    E, I2 = gate_up.shape[0], gate_up.shape[1] * 32
    H = down.shape[1] * 32
    out = torch.empty(N, H)
    hbuf, ybuf = _scratch("moe_h", MOE_GROUP * (3 * I2 // 2 + 2 * H)), _scratch("moe_y", N * K * H)
    order, start = _scratch("moe_order", N * K, torch.int64), _scratch("moe_start", E + 1, torch.int64)
    _lib.moe_experts(x.data_ptr(), ids.data_ptr(), w.data_ptr(), gate_up.data_ptr(), down.data_ptr(),
                     int(gate_up.dtype == torch.bfloat16), out.data_ptr(), hbuf.data_ptr(), ybuf.data_ptr(),
                     order.data_ptr(), start.data_ptr(), N, K, E, H, I2 // 2)
    return out
