"""Batch-invariant operations: a token's numbers do not depend on which other tokens share its batch.

A GEMM library picks kernels, blocking and thread splits from the matrix shape, so the same row
can round differently when it is multiplied alone (decode), beside 15 others (a decode batch) or
beside 2000 others (a trainer's full sequence). Measured on this machine's MKL: one row differs
from the same row in a batch of 8+, and with 2 threads batches of 9-11 rows differ again. So
every op with a reduction gets a fixed shape or a fixed order:

- `linear`: rows are padded into tiles of `TILE` and multiplied as a batch of identical
  (TILE, K) @ (K, N) problems, so every row goes through the same kernel wherever it sits.
- `attention`: per query, scores over keys padded to a multiple of `BLOCK`, masked beyond the
  query's position, summed within each block (a fixed-length reduction) and then across blocks
  left to right. Blocks past the query are exact zeros, so a decode step that sees 200 keys and
  a trainer forward that sees 2000 agree bit for bit.
- `experts`: every (tile of one expert's rows, expert) product is the same fixed-shape GEMM,
  and a token's expert outputs are added in ascending expert id.
- row-wise ops (RMSNorm, softmax, log_softmax, top-k) reduce along one row of fixed length and
  are batch-invariant as they stand (checked in the tests).
- `sigmoid`, `silu`: ATen's kernels for these round differently in a loop's vectorized body and
  in its scalar remainder (~4% of values differ in the last bit), and which elements fall in the
  remainder depends on the tensor's size and the CPU's vector width (the last <32 floats with
  AVX-512, <16 with AVX2), so a row's activation changed with the number of rows beside it: a
  DeepSeek router's weights and shared expert differed between engine decode and trainer on
  AVX-512. Here they are built from `exp`, whose kernel runs the remainder through the vector
  code too, and exactly rounded arithmetic.
- on a CPU, bf16/fp16 products run in fp32 (torch's half-precision GEMMs are many times slower
  there), rounded back once per product; converted weights are kept between forwards.

`deterministic_mode(model)` switches a Hugging Face model (the trainer's forward) onto these ops;
the engine calls them directly in its own forward. Under both, engine logprobs equal the
trainer's full-sequence logprobs bit for bit. Right-padded or unpadded batches only (the causal
mask is built here, padding masks are ignored); silu activations only. `F.linear`, `F.silu` and
`Tensor.sigmoid` are patched process-wide for the duration of the context: other threads running
a model at the same time go through them too.
"""

import weakref
from contextlib import contextmanager

import torch

TILE = 16  # rows per GEMM problem
BLOCK = 64  # keys per attention block
QUERY_CHUNK = 32  # queries per attention pass (bounds the [.., queries, keys, dim] temporaries)
ATTN_NAME = "strop_deterministic"


def _gemm_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the tile GEMMs run in: fp32 for half-precision tensors on a CPU, where torch's bf16
    GEMMs run 10-50x slower than fp32 ones (no native bf16 units; measured on this AVX2 machine).
    Products of bf16 values are exact in fp32, and the fp32 sum is rounded to the tensor's dtype
    once; engine and trainer both go through here, so they still agree bit for bit."""
    return torch.float32 if t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16) else t.dtype


_converted: dict[int, tuple] = {}  # id(weight) -> (weakref to it, its version, the weight in the GEMM dtype)


def forget_conversions() -> None:
    """Drop every kept conversion. Writes that bypass torch (numpy or C views of a tensor's memory,
    as the weight-sync patcher makes) do not move version counters: call this after them."""
    _converted.clear()


def _weight_in(w: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """w in dtype dt. A weight that needs no gradient here keeps its converted copy until it is
    changed in place through torch (its version counter moves), freed, or `forget_conversions`
    runs, so an engine or a no-grad recompute does not convert every weight on every forward; under
    autograd the conversion is part of the graph."""
    if w.dtype == dt:
        return w
    if torch.is_grad_enabled() and w.requires_grad:
        return w.to(dt)
    hit = _converted.get(id(w))
    if hit is not None and hit[0]() is w and hit[1] == w._version:
        return hit[2]
    if hit is None or hit[0]() is not w:
        weakref.finalize(w, _converted.pop, id(w), None)
    out = w.detach().to(dt)
    _converted[id(w)] = (weakref.ref(w), w._version, out)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` whose value for a row never depends on the other rows: x [..., K] @ weight[N, K].T."""
    lead, K, N = x.shape[:-1], x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    n = max(1, -(-M // TILE))
    dt = _gemm_dtype(x)
    if M == n * TILE and x2.is_contiguous() and x2.data_ptr() % 64 == 0 and dt == x.dtype:
        buf = x2  # already whole tiles, cache-line aligned like a fresh buffer
    else:  # a fresh buffer also fixes alignment, which MKL's results may depend on
        buf = x2.new_zeros(n * TILE, K, dtype=dt)
        buf[:M] = x2
    w = _weight_in(weight, dt).t().unsqueeze(0).expand(n, K, N)
    out = torch.bmm(buf.view(n, TILE, K), w).reshape(n * TILE, N)[:M].to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, N)


def _one_plus_exp_neg(f: torch.Tensor) -> torch.Tensor:
    """1 + exp(-f) with the exponent capped at 88 (exp(88) ~ 1.7e38 is finite): below f = -88 the
    sigmoid it divides into stays under 6.1e-39 and gradients stay finite (inf * 0 would be NaN)."""
    return 1 + torch.exp(-f.clamp(min=-88.0))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """`torch.sigmoid` whose value for an element never depends on the tensor's size or layout:
    1 / (1 + exp(-x)), in fp32 for half-precision x, rounded back once."""
    return (1 / _one_plus_exp_neg(x.float())).to(x.dtype)


def silu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """`F.silu` (same signature), batch-invariant like `sigmoid`: x / (1 + exp(-x))."""
    f = x.float()
    out = (f / _one_plus_exp_neg(f)).to(x.dtype)
    return x.copy_(out) if inplace else out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention with a fixed reduction order per query.

    q [B, H, Tq, d], k [B, Hk, Lk, d], v [B, Hk, Lk, dv] (key j sits at position j; query head h
    reads key head h // (H / Hk)), q_pos [B, Tq] the position of each query (it sees keys
    0..q_pos). Returns [B, H, Tq, dv]. Keys past a query's position may hold anything finite (an
    engine's stale cache rows); an Lk that is a multiple of BLOCK saves a padding copy.
    """
    B, H, Tq, d = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    rep = H // Hk
    # Grouped-query heads share their key head's rows: fold them into the query axis instead of
    # copying keys per head (the per-element arithmetic is the same either way).
    q = q.reshape(B, Hk, rep * Tq, d)
    q_pos = q_pos.repeat(1, rep)
    nb = -(-Lk // BLOCK)
    Lp = nb * BLOCK
    if Lp != Lk:
        k = torch.nn.functional.pad(k, (0, 0, 0, Lp - Lk))
        v = torch.nn.functional.pad(v, (0, 0, 0, Lp - Lk))
    key_pos = torch.arange(Lp, device=q.device)
    outs = []
    for c in range(0, rep * Tq, QUERY_CHUNK):
        qc, pc = q[:, :, c : c + QUERY_CHUNK], q_pos[:, c : c + QUERY_CHUNK]
        tc = qc.shape[2]
        s = (qc[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1) * scaling  # [B, Hk, tc, Lp]
        s = s.masked_fill(key_pos[None, None, None, :] > pc[:, None, :, None], float("-inf"))
        p = torch.exp(s - s.amax(-1, keepdim=True))
        den_blocks = p.view(B, Hk, tc, nb, BLOCK).sum(-1)
        num_blocks = (p[..., None] * v[:, :, None, :, :]).view(B, Hk, tc, nb, BLOCK, -1).sum(-2)
        den, num = den_blocks[..., 0], num_blocks[..., 0, :]
        for i in range(1, nb):  # left to right; blocks past the query add exact zeros
            den = den + den_blocks[..., i]
            num = num + num_blocks[..., i, :]
        outs.append(num / den[..., None])
    return torch.cat(outs, dim=2).view(B, H, Tq, -1)


def experts(module, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """MoE experts with a fixed order: x [N, H], ids/weights [N, k] -> [N, H].

    Every product is a batch of identical (TILE, K) @ (K, N) problems, so a row's expert output
    never depends on which rows share its tile; only the grouping into calls changes with N: for
    a decode batch that hits most experts every expert runs on one tile of all rows; otherwise
    each expert's rows are packed into zero-padded tiles, gathered into one bmm per projection
    when there are few tiles or looped per expert when there are many (prefill). The products run
    in `_gemm_dtype`, each rounded back to x's dtype. Per token the k weighted outputs are added
    to zero in ascending expert id. `module` is an HF experts module (gate_up_proj [E, 2I, H],
    down_proj [E, H, I]) with a silu act_fn, computed by `silu`.
    """
    N, k = ids.shape
    E, H = module.num_experts, x.shape[1]
    ids_sorted, perm = ids.sort(dim=1)
    w_sorted = weights.gather(1, perm)
    dt = _gemm_dtype(x)  # weights and tiles in it, each product rounded back to x's dtype

    def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.bmm(a.to(dt), b).to(x.dtype)

    gate_up, down = _weight_in(module.gate_up_proj, dt), _weight_in(module.down_proj, dt)

    def weights_of(e) -> tuple[torch.Tensor, torch.Tensor]:  # experts e's [.., H, 2I] and [.., I, H]
        return gate_up[e].transpose(-1, -2), down[e].transpose(-1, -2)

    flat = ids_sorted.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens ascending within
    counts = torch.bincount(flat, minlength=E)
    tiles = (counts + TILE - 1) // TILE
    expert_of_pair = flat[order]
    rank = torch.arange(N * k) - (counts.cumsum(0) - counts)[expert_of_pair]
    dest = ((tiles.cumsum(0) - tiles)[expert_of_pair] * TILE + rank)  # row of each pair in the tiles
    n_tiles = int(tiles.sum())
    if N <= TILE and n_tiles > E // 2:  # decode with most experts hit: every expert on the one tile of all rows
        buf = x.new_zeros(TILE, H, dtype=dt)
        buf[:N] = x
        gu_w, down_w = weights_of(slice(None))
        gate, up = bmm(buf.expand(E, TILE, H), gu_w).chunk(2, dim=-1)
        y = bmm(silu(gate) * up, down_w)  # [E, TILE, H]
        rows = (ids_sorted * TILE + torch.arange(N)[:, None]).reshape(-1)
        return _ordered_sum(y.reshape(-1, H).index_select(0, rows).view(N, k, H) * w_sorted[..., None])
    tile_expert = torch.repeat_interleave(torch.arange(E), tiles)
    buf = x.new_zeros(n_tiles * TILE, H, dtype=dt).index_copy(0, dest, x.index_select(0, order // k).to(dt))
    tiles_x = buf.view(n_tiles, TILE, H)
    if n_tiles <= 2 * E:  # few tiles per expert: gather their (contiguous) matrices, one bmm per projection
        gu_t, down_t = weights_of(tile_expert)  # gathered (contiguous) matrices, as det.linear sees a weight
        gate, up = bmm(tiles_x, gu_t).chunk(2, dim=-1)
        y = bmm(silu(gate) * up, down_t)
    else:  # many (prefill): per expert, its tiles against the weight broadcast, no copies
        ys, at = [], 0
        for e, t in enumerate(tiles.tolist()):
            if t:
                gu_w, down_w = weights_of(e)
                gate, up = bmm(tiles_x[at : at + t], gu_w.expand(t, -1, -1)).chunk(2, dim=-1)
                ys.append(bmm(silu(gate) * up, down_w.expand(t, -1, -1)))
                at += t
        y = torch.cat(ys)
    contrib = torch.empty(N * k, H, dtype=x.dtype).index_copy(0, order, y.reshape(-1, H).index_select(0, dest))
    return _ordered_sum(contrib.view(N, k, H) * w_sorted[..., None])


def _ordered_sum(contrib: torch.Tensor) -> torch.Tensor:
    """[N, k, H] -> [N, H], adding to zero in k order (the eager HF experts loop's order)."""
    out = torch.zeros_like(contrib[:, 0])
    for j in range(contrib.shape[1]):
        out = out + contrib[:, j]
    return out


def _hf_experts(self, hidden_states, top_k_index, top_k_weights):
    """`experts` behind the Hugging Face experts-implementation interface."""
    return experts(self, hidden_states, top_k_index, top_k_weights)


def _hf_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """`attention` behind the Hugging Face attention-function interface (queries are the last Tq keys)."""
    B, _, Tq, _ = query.shape
    Lk = key.shape[2]
    q_pos = torch.arange(Lk - Tq, Lk, device=query.device).expand(B, Tq)
    return attention(query, key, value, q_pos, scaling).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    AttentionInterface.register(ATTN_NAME, _hf_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)  # built by HF, ignored by `_hf_attention`
    ALL_EXPERTS_FUNCTIONS.register(ATTN_NAME, _hf_experts)


@contextmanager
def deterministic_mode(model):
    """Run a Hugging Face policy on batch-invariant ops: `attention`, `experts`, every `F.linear`
    tiled, every `F.silu` and `Tensor.sigmoid` (the DeepSeek router's) through `silu` and `sigmoid`."""
    cfg = model.config
    if cfg.hidden_act != "silu":
        raise ValueError(f"deterministic mode computes silu activations only, not {cfg.hidden_act}")
    _register()
    saved = (cfg._attn_implementation, getattr(cfg, "_experts_implementation", None), torch.nn.functional.linear,
             torch.nn.functional.silu, torch.Tensor.sigmoid)
    cfg._attn_implementation = ATTN_NAME
    if saved[1] is not None:
        cfg._experts_implementation = ATTN_NAME
    torch.nn.functional.linear, torch.nn.functional.silu, torch.Tensor.sigmoid = linear, silu, sigmoid
    try:
        yield model
    finally:
        torch.nn.functional.linear, torch.nn.functional.silu, torch.Tensor.sigmoid = saved[2:]
        cfg._attn_implementation = saved[0]
        if saved[1] is not None:
            cfg._experts_implementation = saved[1]
