"""C kernels for the CPU forward pass of the engine and the trainer, and for the engine's sampler,
built with the system C compiler and called through ctypes (the C is in this package's .c files:
core.c, attention.c, sampling.c, moe.c and step.c, one translation unit).

Why: on a small model a decode step is hundreds of tiny ops, each costing more in dispatch than
in arithmetic; at decode each expert sees one or two tokens, so grouped GEMMs become dozens of
tiny calls per layer; top-p wants a full sort. And a GEMM library picks kernels, blocking and
thread splits from the matrix shape, so the same row rounds differently alone, beside 15 others or
beside 2000: the engine and the trainer could not agree to the bit. These kernels are
batch-invariant by construction (see core.c): a row's result never depends on the
other rows of a call, so the engine (any batch, slot, neighbours, prefix reuse) and the trainer
(whole sequences, `strop.model.deterministic`) compute the same bits.

They compute in fp32 over fp32 or bf16 weights (widened exactly) packed by `pack_linear` /
`pack_experts` (rebuilt after every weight update). Without a C compiler (or with
STROP_NO_KERNELS set), `available()` is False and callers run PyTorch ops instead (`SLOW_PATH`).
The shared object is cached under ~/.cache/strop keyed by the source and this CPU's flags (it is
built with -march=native), so a copy built on another machine is never loaded.
"""

import ctypes
import subprocess
import threading
from dataclasses import dataclass

import numpy as np
import torch

from strop.native import load_library, read_sources

SOURCES = ("core.c", "attention.c", "sampling.c", "moe.c", "step.c")  # one translation unit, in this order
SLOW_PATH = "PyTorch ops (the torch forward and sampler; no deterministic mode)"
MOE_GROUP = 16  # moe.c's MOE_GROUP: most rows of one expert per pass (sizes moe_experts' scratch)
_lib: ctypes.CDLL | None = None
_held: ctypes.PyDLL | None = None  # the same library, its calls keeping the GIL
_tried = False
_threads = 0  # threads the matrix kernels split products between (0: torch's count when they load)
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
    global _held
    lib = load_library("moe", read_sources(__name__, *SOURCES), slow_path=SLOW_PATH)
    if lib is None:
        return None
    P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    for name, args in (
        ("add_rmsnorm", [P] * 4 + [I64] * 2 + [F32]),
        ("linear_packed", [P, I64, P, I64, P, P, I64, I64]),
        ("silu_mul", [P, I64, P, I64, P, I64, I64]),
        ("silu_mul_backward", [P, I64, P, I64, P, P, I64, P, I64, P, I64, I64]),
        ("qk_norm_rope", [P, I64] + [P] * 5 + [I64] * 4 + [F32]),
        ("attention_rows", [P, I64] + [P] * 7 + [I64] * 6 + [F32]),
        ("route_softmax", [P, I64, P, P] + [I64] * 4),
        ("route_softmax_at", [P, I64, P, P] + [I64] * 4),
        ("moe_experts", [P] * 5 + [I64] + [P] * 6 + [I64] * 5),
        ("forward_rows", [P] * 3 + [I64, P, I64] + [P] * 7),
        ("set_kernel_threads", [I64]),
    ):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, args
    lib.set_kernel_threads(_threads or torch.get_num_threads())
    # Calls of microseconds on an engine's step through a handle that keeps the GIL: an engine thread
    # that gives it up beside rollout threads running Python waits up to a switch interval (0.5 ms,
    # `strop.threads.hand_over_gil_quickly`) to win it back.
    _held = ctypes.PyDLL(lib._name)
    for name, args in (("sample_rows", [P] * 8 + [I64] * 2), ("forward_rows_scratch", [P, I64, I64, P])):
        fn = getattr(_held, name)
        fn.restype, fn.argtypes = None, args
    return lib


def set_threads(n: int) -> None:
    """Split the matrix kernels' large products between n threads (`strop.threads.set_threads` calls
    this; engines pinned to one core run on one). Each output is computed whole by one thread: the
    bits do not depend on n."""
    global _threads
    _threads = n
    if _lib is not None:
        _lib.set_kernel_threads(n)


def available() -> bool:
    """Whether the compiled kernels can be used (built on first call)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        try:
            _lib = _build()
        except (OSError, subprocess.SubprocessError):
            _lib = None
    return _lib is not None


def function(name: str, keep_gil: bool = False) -> ctypes._CFuncPtr:
    """The kernel `name`, its ctypes signature set once in `_build`, for wrappers outside this module;
    `keep_gil`: one of the short calls bound to keep the GIL while it runs."""
    return getattr(_held if keep_gil else _lib, name)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _f32(t: torch.Tensor) -> torch.Tensor:
    assert t.dtype == torch.float32, f"the kernels take fp32 tensors, not {t.dtype}"
    return t.contiguous()


# -- weights ---------------------------------------------------------------------------------------


def is_bf16_exact(w: torch.Tensor) -> bool:
    """Whether every value of w is a bf16 value: a bf16 tensor, or fp32 whose low 16 bits are zero
    (an engine whose weights arrive from the trainer as bf16 snapshots)."""
    if w.dtype == torch.bfloat16:
        return True
    return w.dtype == torch.float32 and not bool((w.detach().contiguous().view(torch.int32) & 0xFFFF).any())


@dataclass(frozen=True)
class Packed:
    """A weight [n, m] (y = x @ weight.T) in the matrix kernels' layout: [ceil(n / 32), m, 32],
    zero columns padding the last block; bf16 when its values are bf16 values, else fp32."""

    data: torch.Tensor
    n: int  # output width (unpadded)

    @property
    def bf16(self) -> bool:
        return self.data.dtype == torch.bfloat16


def pack_linear(weight: torch.Tensor, as_bf16: bool | None = None) -> Packed:
    """An nn.Linear weight [n, m] packed for `linear`; as_bf16 None = bf16 exactly when lossless."""
    n, m = weight.shape
    as_bf16 = is_bf16_exact(weight) if as_bf16 is None else as_bf16
    w = weight.detach().to(torch.bfloat16 if as_bf16 else torch.float32)
    padded = -(-n // 32) * 32
    if padded != n:
        w = torch.cat([w, w.new_zeros(padded - n, m)])
    return Packed(w.t().reshape(m, padded // 32, 32).permute(1, 0, 2).contiguous(), n)


def linear(x: torch.Tensor, w: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, m] fp32 times a packed weight (+ bias [n] fp32): [N, n]."""
    x = _f32(x)
    N, m = x.shape
    padded = w.data.shape[0] * 32
    out = torch.empty(N, padded)
    if bias is not None and padded != w.n:
        bias = torch.cat([_f32(bias), bias.new_zeros(padded - w.n)])
    _lib.linear_packed(
        x.data_ptr(),
        N,
        w.data.data_ptr(),
        int(w.bf16),
        _ptr(None if bias is None else _f32(bias)),
        out.data_ptr(),
        m,
        padded,
    )
    return out if padded == w.n else out[:, : w.n]


def pack_experts(gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF expert weights gate_up_proj [E, 2I, H] and down_proj [E, H, I] in the kernel's layout: each
    projection transposed to [E, in, out], then cut into 32-output column blocks [E, out / 32, in, 32]
    (see `vecmat`). Stored as bf16 when both hold only bf16 values (lossless, and half the bytes
    each decode step streams through the cache), else fp32."""
    as_bf16 = is_bf16_exact(gate_up_proj) and is_bf16_exact(down_proj)

    def blocked(w: torch.Tensor) -> torch.Tensor:  # [E, out, in] -> [E, out / 32, in, 32]
        E, n_out, n_in = w.shape
        w = w.detach().to(torch.bfloat16 if as_bf16 else torch.float32)
        return w.transpose(1, 2).reshape(E, n_in, n_out // 32, 32).permute(0, 2, 1, 3).contiguous()

    return blocked(gate_up_proj), blocked(down_proj)


def experts_fit(gate_up_proj: torch.Tensor) -> bool:
    """Whether `moe_experts` computes experts of these shapes: hidden and 2 x intermediate widths
    multiples of 32."""
    _, I2, H = gate_up_proj.shape
    return H % 32 == 0 and I2 % 32 == 0


# -- row ops ---------------------------------------------------------------------------------------


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm(h) * weight [D] as a new [N, D] tensor; with `residual`, h += residual in place first
    (h must then be contiguous)."""
    if residual is not None:
        assert h.is_contiguous() and h.dtype == torch.float32
    else:
        h = _f32(h)
    N, D = h.shape
    out = torch.empty(N, D)
    _lib.add_rmsnorm(
        h.data_ptr(),
        _ptr(None if residual is None else _f32(residual)),
        _f32(weight).data_ptr(),
        out.data_ptr(),
        N,
        D,
        eps,
    )
    return out


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for [N, I] rows (each may be a column slice of a wider row)."""
    assert g.dtype == u.dtype == torch.float32 and g.stride(1) == u.stride(1) == 1
    N, I = g.shape
    out = torch.empty(N, I)
    _lib.silu_mul(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), out.data_ptr(), N, I)
    return out


def silu_mul_backward(g: torch.Tensor, u: torch.Tensor, d_act: torch.Tensor, with_act: bool = False):
    """(d g, d u) of act = silu(g) * u for [N, I] rows (column slices allowed) given d act [N, I], as
    two column halves of one [N, 2I] tensor; with_act also act itself."""
    assert g.dtype == u.dtype == torch.float32 and g.stride(1) == u.stride(1) == 1
    N, I = g.shape
    d_act = _f32(d_act)
    grads = torch.empty(N, 2 * I)
    act = torch.empty(N, I) if with_act else None
    _lib.silu_mul_backward(
        g.data_ptr(),
        g.stride(0),
        u.data_ptr(),
        u.stride(0),
        d_act.data_ptr(),
        grads.data_ptr(),
        2 * I,
        grads[:, I:].data_ptr(),
        2 * I,
        _ptr(act),
        N,
        I,
    )
    return (grads, act) if with_act else grads


def qk_norm_rope(
    src: torch.Tensor,
    weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    n_q: int,
    eps: float,
    heads: int | None = None,
) -> torch.Tensor:
    """Per-head RMSNorm (weight [nq + nk, d]; None: no norm, `heads` heads, as in Llama) and rotation
    by position (tables cos, sin [P, d], sin carrying the rotate-half sign) of rows src
    [N, (nq + nk) d] (row stride free): [N, nq + nk, d]."""
    assert src.dtype == torch.float32 and src.stride(1) == 1 and positions.dtype == torch.int64
    heads, d = weight.shape if weight is not None else (heads, src.shape[1] // heads)
    N = src.shape[0]
    assert src.shape[1] == heads * d
    out = torch.empty(N, heads, d)
    _lib.qk_norm_rope(
        src.data_ptr(),
        src.stride(0),
        _ptr(None if weight is None else _f32(weight)),
        cos.data_ptr(),
        sin.data_ptr(),
        positions.contiguous().data_ptr(),
        out.data_ptr(),
        N,
        n_q,
        heads - n_q,
        d,
        eps,
    )
    return out


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    with_lse: bool = False,
):
    """Query rows q [N, nq, dk] (row stride free) against keys 0..position of their cache slot
    (k_cache [S, nk, L, dk], v_cache [S, nk, L, dv]): [N, nq, dv], and with_lse the log of each
    query head's softmax denominator [N, nq]."""
    _, n_k, L, dk = k_cache.shape
    dv = v_cache.shape[-1]
    N, n_q = q.shape[0], q.shape[1]
    assert q.dtype == torch.float32 and q.stride(2) == 1 and q.stride(1) == dk and dk % 8 == 0 and dv % 8 == 0
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    out = torch.empty(N, n_q, dv)
    lse = torch.empty(N, n_q) if with_lse else None
    scores = _scratch("scores", L)
    _lib.attention_rows(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.contiguous().data_ptr(),
        positions.contiguous().data_ptr(),
        out.data_ptr(),
        _ptr(lse),
        scores.data_ptr(),
        N,
        n_q,
        n_k,
        dk,
        dv,
        L,
        scale,
    )
    return (out, lse) if with_lse else out


def route_softmax(logits: torch.Tensor, n_experts: int, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A softmax router's top-k over the first n_experts columns of logits [N, >= n_experts] (row
    stride free): (weights [N, k] fp32, ids [N, k] int64), largest first."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    N = logits.shape[0]
    w, ids = torch.empty(N, k), torch.empty(N, k, dtype=torch.int64)
    _lib.route_softmax(logits.data_ptr(), logits.stride(0), ids.data_ptr(), w.data_ptr(), N, n_experts, k, int(norm))
    return w, ids


def route_softmax_at(logits: torch.Tensor, n_experts: int, ids: torch.Tensor, norm: bool) -> torch.Tensor:
    """`route_softmax`'s weights for given experts ids [N, k] (router replay): [N, k] fp32."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    ids = ids.to(torch.int64).contiguous()
    N, k = ids.shape
    w = torch.empty(N, k)
    _lib.route_softmax_at(logits.data_ptr(), logits.stride(0), ids.data_ptr(), w.data_ptr(), N, n_experts, k, int(norm))
    return w


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    save: bool = False,
):
    """sum_k weights[n, k] * down(silu(gate) * up)(x[n]) through expert ids[n, k]: [N, H] fp32; with
    `save` also (for a backward pass) the assignments (n * k + j) sorted by expert [N * k], their
    gate/up projections in that order [N * k, 2I] and every assignment's expert output [N * k, H]."""
    assert _lib is not None
    x, w = _f32(x), weights.float().contiguous()
    ids = ids.to(torch.int64).contiguous()
    N, K = ids.shape
    E, I2 = gate_up.shape[0], gate_up.shape[1] * 32
    H = down.shape[1] * 32
    out = torch.empty(N, H)
    hbuf = _scratch("moe_h", MOE_GROUP * (3 * I2 // 2 + 2 * H))
    ybuf = torch.empty(N * K, H) if save else _scratch("moe_y", N * K * H)
    gu_save = torch.empty(N * K, I2) if save else None
    order = torch.empty(N * K, dtype=torch.int64) if save else _scratch("moe_order", N * K, torch.int64)
    start = _scratch("moe_start", E + 1, torch.int64)
    _lib.moe_experts(
        x.data_ptr(),
        ids.data_ptr(),
        w.data_ptr(),
        gate_up.data_ptr(),
        down.data_ptr(),
        int(gate_up.dtype == torch.bfloat16),
        out.data_ptr(),
        hbuf.data_ptr(),
        ybuf.data_ptr(),
        _ptr(gu_save),
        order.data_ptr(),
        start.data_ptr(),
        N,
        K,
        E,
        H,
        I2 // 2,
    )
    return (out, order, gu_save, ybuf) if save else out


# -- sampling --------------------------------------------------------------------------------------


def sample_rows(
    x: np.ndarray, top_p: np.ndarray, u: np.ndarray, greedy: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(probabilities [N, V], token [N], p[token] / kept mass [N]) for fp32 logit rows x [N, V],
    top_p [N] and u [N] in (0, 1] (fp32), greedy [N] (int64, nonzero: take the first largest logit):
    the row softmax (its exp within 2 ulp of expf; torch's is within 1), then the greedy token or the
    top-p draw, in one call that keeps the GIL (see `_build`)."""
    N, V = x.shape
    probs, scratch = np.empty((N, V), np.float32), np.empty(V, np.float32)
    tok, ratio = np.empty(N, np.int64), np.empty(N, np.float32)
    x = np.ascontiguousarray(x, np.float32)
    arrays = (x, probs, top_p, u, greedy, tok, ratio, scratch)
    _held.sample_rows(*(a.ctypes.data for a in arrays), N, V)
    return probs, tok, ratio
