"""The engine's own forward pass over a Hugging Face policy's weights, with a slot-indexed KV cache.

It reads the model's parameters in place, so a weight update applied to the model is what the
next step runs; the derived tensors (packed and fused weights, the one-call step) are rebuilt by
`refresh(names)`, which the engine calls after every update, for the changed tensors only; or
prepared from the new values before they are written (`prepare`, while the engine keeps
decoding) and swapped in at the pause (`install`). A batch is a list of segments (slot, first
position, tokens): decode tokens, whole prompts and prompt suffixes after reused keys, all rows of
one pass. Past the last attention only each segment's final row feeds a logit, so the last MLP
runs on those rows alone (its router still sees every row, for the routing record). No HF cache
objects.

Two paths:

- Kernels (fp32 weights and the C kernels at hand, or `deterministic`): the batch-invariant
  forward of `strop.model.deterministic` over the KV cache, each row attending to its cached keys
  0..position; for a softmax-routed MoE (qwen3_moe) the whole pass is one C call
  (`strop.engine.rows_step`), the same kernels chained in C. A row's numbers depend on its own
  sequence only — not on the batch, its slot, its neighbours or whether its prefix was reused — so
  they equal the trainer's under `deterministic_mode` bit for bit. Activations are fp32.
- Torch (no compiler, or non-fp32 weights without `deterministic`): fused q/k/v GEMM, precomputed
  RoPE tables, fused RMSNorm, SDPA, `F.grouped_mm` experts; close to the trainer but not bitwise.
"""

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from strop import kernels
from strop.engine import rows_step
from strop.model import deterministic as det
from strop.model import kernel_ops
from strop.model.routing import moe_blocks, route, router_logits, routing_dtype


@dataclass
class Derived:
    """The derived weights of the tensors `changed` (ids; None: every tensor), from `Forward.prepare`."""

    changed: set[int] | None
    fused: dict = field(default_factory=dict)  # torch path, by attention module id
    qkv_sizes: dict = field(default_factory=dict)
    qk_norm: dict = field(default_factory=dict)
    step: rows_step.StepPacks | None = None  # kernel path: the C step's packs (new for the changed layers)
    packs: dict = field(default_factory=dict)  # kernel path: `kernel_ops`' kept packs of changed tensors, rebuilt


@dataclass
class Segment:
    slot: int  # KV-cache row of the sequence
    start: int  # position of the first token
    tokens: list[int]


@dataclass
class _Plan:
    """Index tensors for one call of the torch path, built once and shared by every layer."""

    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N]
    decode_rows: torch.Tensor | None  # rows that are one-token segments, or None
    decode_slots: torch.Tensor | slice | None  # their cache rows (a slice when contiguous: no copy)
    decode_pos: torch.Tensor | None  # [B, 1]
    decode_len: int
    all_decode: bool  # every row is a decode row, in order
    prefills: list[tuple[int, int, int, int]]  # (first row, tokens, slot, start position)
    ends: torch.Tensor | None  # each segment's last row (None when every row is one)
    groups: list[torch.Tensor]  # [G, n] rows of G prefills of n tokens from position 0


def _rows(segments: list[Segment]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, slots, positions) per row and each segment's last row, as int64 arrays (numpy: unlike
    torch calls, building them never gives up the GIL; see `strop.engine.sampling`)."""
    tokens = np.array([t for s in segments for t in s.tokens], np.int64)
    slots = np.array([s.slot for s in segments], np.int64)
    starts = np.array([s.start for s in segments], np.int64)
    if len(tokens) == len(segments):  # a pure decode step
        return tokens, slots, starts, np.arange(len(segments), dtype=np.int64)
    lens = np.array([len(s.tokens) for s in segments], np.int64)
    ends = lens.cumsum() - 1
    positions = np.arange(len(tokens), dtype=np.int64) - np.repeat(ends - lens + 1 - starts, lens)
    return tokens, np.repeat(slots, lens), positions, ends


class Forward:
    """forward(segments) -> (last-token logits [S, V], expert ids [N, n_moe_layers, k] | None)."""

    def __init__(self, model, max_slots: int, max_len: int, deterministic: bool = False):
        self.model, self.cfg = model, model.config
        self.arch = self.cfg.model_type
        if self.arch not in det.ARCHITECTURES:
            raise ValueError(f"the engine does not implement the {self.arch} architecture")
        if deterministic:
            det.check_supported(model)
        dtype = next(model.parameters()).dtype
        self.kernel_path = deterministic or (dtype == torch.float32 and det.unsupported(model) is None)
        self.max_slots, self.max_len = max_slots, max_len
        self.blocks = moe_blocks(model)
        self.num_experts = self.blocks[0].gate.num_experts if self.blocks else 0
        self._routing_np = torch.empty(0, dtype=routing_dtype(self.num_experts)).numpy().dtype  # for the C step's ids
        cache_dtype = torch.float32 if self.kernel_path else dtype
        self.k_cache, self.v_cache = [], []
        for layer in model.model.layers:
            heads, dk, dv = self._kv_shape(layer.self_attn)
            self.k_cache.append(torch.zeros(max_slots, heads, max_len, dk, dtype=cache_dtype))
            self.v_cache.append(torch.zeros(max_slots, heads, max_len, dv, dtype=cache_dtype))
        # The torch path's lean version (not DeepSeek's MLA): precomputed RoPE tables, joint q/k norm
        # and rotation, batched prefill attention.
        self.fast = not self.kernel_path and self.arch != "deepseek_v3"
        if self.fast:  # cos and sin for every position, the rotate-half sign folded into sin
            with torch.no_grad():
                cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=dtype), torch.arange(max_len)[None])
            half = cos.shape[-1] // 2
            sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(dtype)
            self._cos, self._sin = cos[0][:, None, :].contiguous(), (sin[0] * sign)[:, None, :].contiguous()
        # every tensor by name, tied ones under each of their names (lm_head.weight too); the model's
        # tensors are updated in place, never replaced, so this stays true
        self.named = {
            **dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False)),
        }
        self._fits_step = self.kernel_path and rows_step.fits(model)
        self._packs: rows_step.StepPacks | None = None
        self._fused, self._qkv_sizes, self._qk_norm, self._step = {}, {}, {}, None
        self.refresh()

    def _kv_shape(self, attn) -> tuple[int, int, int]:
        if self.arch == "deepseek_v3":  # MLA: cache the expanded per-head keys and values
            return attn.num_heads, attn.qk_head_dim, attn.v_head_dim
        return self.cfg.num_key_value_heads, attn.head_dim, attn.head_dim

    def refresh(self, names: Collection[str] | None = None) -> None:
        """Rebuild the weights derived from the model's; call after changing weights. `names`: the
        tensors that changed (`named_parameters` / `named_buffers` names); only their derived weights
        are rebuilt. None: all of them."""
        self.install(self.prepare(names))

    def prepare(
        self, names: Collection[str] | None = None, weights: Mapping[str, torch.Tensor] | None = None
    ) -> Derived:
        """The derived weights of the tensors `names` (None: all), computed from `weights` (new values
        by name, the model's dtype; the model's own tensors for the rest) without changing what this
        forward runs: an engine prepares an update's repacking while it keeps decoding, writes the new
        values into the model, and `install`s these at the same pause."""
        for n in (*(names or ()), *(weights or {})):
            if n not in self.named:
                raise ValueError(f"weight {n!r}: no such tensor in the model")
        changed = None if names is None else {id(self.named[n]) for n in names}
        new = {id(self.named[n]): t for n, t in (weights or {}).items()}

        def get(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else new.get(id(t), t)

        out = Derived(changed)
        if self.kernel_path:
            if self._fits_step:
                out.step = rows_step.pack(
                    self.model, self.max_len, changed, new, None if changed is None else self._packs
                )
            if changed is not None:
                out.packs = kernel_ops.repack(changed, new)
            return out
        if not self.fast:
            return out
        with torch.no_grad():
            for layer in self.model.model.layers:
                a = layer.self_attn
                if not rows_step.reads(a, changed):
                    continue
                projs = (a.q_proj, a.k_proj, a.v_proj)
                w = torch.cat([get(p.weight) for p in projs])
                b = torch.cat([get(p.bias) for p in projs]) if a.q_proj.bias is not None else None
                out.fused[id(a)] = (w, b)
                out.qkv_sizes[id(a)] = [p.weight.shape[0] for p in projs]
                heads, kv_heads = a.q_proj.weight.shape[0] // a.head_dim, a.k_proj.weight.shape[0] // a.head_dim
                if hasattr(a, "q_norm"):  # Qwen3; Llama has no q/k norm
                    out.qk_norm[id(a)] = torch.cat(
                        [get(a.q_norm.weight).expand(heads, -1), get(a.k_norm.weight).expand(kv_heads, -1)]
                    )
        return out

    def install(self, derived: Derived) -> None:
        """Make prepared derived weights the ones this forward runs (after their new values were
        written into the model): a dictionary update and, on the kernel path, a new pointer table for
        the C step."""
        if derived.changed is None:
            kernel_ops.forget_packs()  # updates may write through numpy views, unseen by version counters
            self._fused, self._qkv_sizes, self._qk_norm = {}, {}, {}
        else:
            kernel_ops.install_packs(derived.packs, derived.changed)
        for mine, new in (
            (self._fused, derived.fused),
            (self._qkv_sizes, derived.qkv_sizes),
            (self._qk_norm, derived.qk_norm),
        ):
            mine.update(new)
        if derived.step is not None:
            self._packs = derived.step
            self._step = rows_step.RowsStep(self.model, self.k_cache, self.v_cache, derived.step)

    @torch.inference_mode()
    def __call__(self, segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor | None]:
        for s in segments:
            assert s.start + len(s.tokens) <= self.max_len, "sequence longer than the KV cache"
        if self.kernel_path:
            return self._kernel_forward(segments)
        return self._torch_forward(segments)

    # -- the kernel path ---------------------------------------------------------------------------

    def _kernel_forward(self, segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows_np = _rows(segments)
        if self._step is not None:
            logits, ids = self._step(*rows_np)
            return logits, torch.from_numpy(ids.astype(self._routing_np)) if self.blocks else None
        tokens, slots, positions, ends = (torch.from_numpy(a) for a in rows_np)
        model, routing = self.model, []

        def attend(li, q, k, v, scale):  # write the rows' keys, then every row reads its own 0..position
            kc, vc = self.k_cache[li], self.v_cache[li]
            kc[slots, :, positions] = k
            vc[slots, :, positions] = v
            return kernels.attention(q, kc, vc, slots, positions, scale)

        def router(block, x):
            _, weights, ids = det.gate_route(block.gate, x)
            routing.append(ids)
            return weights, ids

        rows = det.Rows(positions, attend, router)
        h = det.embed(model, tokens)
        last_layer = len(model.model.layers) - 1
        for li in range(last_layer + 1):
            h = det.layer(model, li, h, rows, ends if li == last_layer else None)
        logits = det.head(model, det.final_norm(model, h))
        return logits, torch.stack(routing, dim=1).to(routing_dtype(self.num_experts)) if routing else None

    # -- the torch path ----------------------------------------------------------------------------

    def _plan(self, segments: list[Segment]) -> _Plan:
        lens = [len(s.tokens) for s in segments]
        positions = torch.cat([torch.arange(s.start, s.start + n) for s, n in zip(segments, lens)])
        slots = torch.cat([torch.full((n,), s.slot) for s, n in zip(segments, lens)])
        firsts = [0]
        for n in lens[:-1]:
            firsts.append(firsts[-1] + n)
        dec = [i for i, n in enumerate(lens) if n == 1]
        rows = dsl = dpos = None
        dlen = 0
        if dec:
            rows = torch.tensor([firsts[i] for i in dec]) if len(dec) < len(segments) else torch.arange(len(dec))
            slot_list = [segments[i].slot for i in dec]
            s0 = slot_list[0]
            contiguous = slot_list == list(range(s0, s0 + len(dec)))
            dsl = slice(s0, s0 + len(dec)) if contiguous else torch.tensor(slot_list)
            dpos = positions[rows][:, None]
            dlen = int(dpos.max()) + 1
        prefills = [(firsts[i], n, segments[i].slot, segments[i].start) for i, n in enumerate(lens) if n > 1]
        all_decode = len(dec) == len(segments)
        ends = None if all_decode else torch.tensor(firsts) + torch.tensor(lens) - 1
        groups: dict[int, list[int]] = {}
        if self.fast:  # prompts of one length attend together, causally, without reading the cache
            for r0, n, _, start in prefills:
                if start == 0:
                    groups.setdefault(n, []).append(r0)
        rows_of = [torch.tensor(r0s)[:, None] + torch.arange(n) for n, r0s in groups.items()]
        return _Plan(positions, slots, rows, dsl, dpos, dlen, all_decode, prefills, ends, rows_of)

    def _torch_forward(self, segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor | None]:
        plan = self._plan(segments)
        tokens = torch.tensor([t for s in segments for t in s.tokens])
        inner = self.model.model
        h = inner.embed_tokens(tokens)
        if self.fast:
            cos, sin = self._cos[plan.positions], self._sin[plan.positions]
        else:
            cos, sin = inner.rotary_emb(h[None], plan.positions[None])
        routing: list[torch.Tensor] = []
        last_layer = len(inner.layers) - 1
        for li, layer in enumerate(inner.layers):
            x = self._norm(layer.input_layernorm, h)
            h = h + self._attention(li, layer.self_attn, x, cos, sin, plan)
            x = self._norm(layer.post_attention_layernorm, h)
            rows = plan.ends if li == last_layer else None  # the last MLP on each segment's final row
            h = (h if rows is None else h[rows]) + self._mlp(layer.mlp, x, routing, rows)
        logits = F.linear(self._norm(inner.norm, h), self.model.lm_head.weight)
        ids = torch.stack(routing, dim=1).to(routing_dtype(self.num_experts)) if routing else None
        return logits, ids

    @staticmethod
    def _norm(mod, x):
        return F.rms_norm(x, mod.weight.shape, mod.weight, mod.variance_epsilon)

    def _qkv(self, attn, x, cos, sin):
        """q [N, H, dk], k [N, Hk, dk], v [N, Hk, dv] for token rows x [N, hidden]."""
        N = x.shape[0]
        if self.arch == "deepseek_v3":
            from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

            rotate = m.apply_rotary_pos_emb_interleave if self.cfg.rope_interleave else m.apply_rotary_pos_emb
            if attn.q_lora_rank is None:
                q = F.linear(x, attn.q_proj.weight)
            else:
                q = F.linear(
                    self._norm(attn.q_a_layernorm, F.linear(x, attn.q_a_proj.weight, attn.q_a_proj.bias)),
                    attn.q_b_proj.weight,
                )
            q = q.view(1, N, -1, attn.qk_head_dim).transpose(1, 2)
            q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
            ckv = F.linear(x, attn.kv_a_proj_with_mqa.weight, attn.kv_a_proj_with_mqa.bias)
            kv_nope, k_rot = torch.split(ckv, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
            kv_nope = self._norm(attn.kv_a_layernorm, kv_nope)
            q_rot, k_rot = rotate(q_rot, k_rot.view(1, 1, N, -1), cos, sin)
            q = torch.cat((q_pass, q_rot), dim=-1)[0].transpose(0, 1)
            kv = F.linear(kv_nope, attn.kv_b_proj.weight).view(N, -1, attn.qk_nope_head_dim + attn.v_head_dim)
            k_nope, v = torch.split(kv, [attn.qk_nope_head_dim, attn.v_head_dim], dim=-1)
            k = torch.empty(N, k_nope.shape[1], attn.qk_head_dim, dtype=x.dtype)
            k[..., : attn.qk_nope_head_dim] = k_nope
            k[..., attn.qk_nope_head_dim :] = k_rot[0, 0][:, None, :]
            return q, k, v
        d = attn.head_dim  # one GEMM, one norm and one rotation for q and k together
        qkv = F.linear(x, *self._fused[id(attn)]).view(N, -1, d)
        nq, nk = (s // d for s in self._qkv_sizes[id(attn)][:2])
        qk = qkv[:, : nq + nk]
        if id(attn) in self._qk_norm:
            qk = F.rms_norm(qk, (d,), None, attn.q_norm.variance_epsilon) * self._qk_norm[id(attn)]
        qk = qk * cos + qk.roll(d // 2, -1) * sin
        return qk[:, :nq], qk[:, nq:], qkv[:, nq + nk :]

    def _attention(self, li, attn, x, cos, sin, plan: _Plan):
        q, k, v = self._qkv(attn, x, cos, sin)
        kc, vc = self.k_cache[li], self.v_cache[li]
        kc[plan.slots, :, plan.positions] = k
        vc[plan.slots, :, plan.positions] = v
        out = torch.empty(q.shape[0], q.shape[1], vc.shape[-1], dtype=q.dtype)
        if plan.decode_rows is not None:
            rows, L = plan.decode_rows, plan.decode_len
            K, V = kc[plan.decode_slots, :, :L], vc[plan.decode_slots, :, :L]
            out[rows] = self._attend(attn, q[rows][:, :, None], K, V, plan.decode_pos)[:, :, 0]
        for rows in plan.groups:  # [G, n] rows of prompts starting at position 0: causal among themselves
            qs, ks, vs = (t[rows].transpose(1, 2) for t in (q, k, v))
            out[rows] = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=attn.scaling, enable_gqa=ks.shape[1] != qs.shape[1]
            ).transpose(1, 2)
        for r0, n, slot, start in plan.prefills:
            if plan.groups and start == 0:
                continue
            qs = q[r0 : r0 + n].transpose(0, 1)[None]
            o = self._attend(
                attn,
                qs,
                kc[slot : slot + 1, :, : start + n],
                vc[slot : slot + 1, :, : start + n],
                plan.positions[None, r0 : r0 + n],
            )
            out[r0 : r0 + n] = o[0].transpose(0, 1)
        return F.linear(out.reshape(out.shape[0], -1), attn.o_proj.weight, attn.o_proj.bias)

    @staticmethod
    def _attend(attn, q, K, V, q_pos):
        """q [B, H, Tq, dk] against keys K/V [B, Hk, L, *]; returns [B, H, Tq, dv]."""
        mask = torch.arange(K.shape[2])[None, None, None, :] <= q_pos[:, None, :, None]
        return F.scaled_dot_product_attention(
            q, K, V, attn_mask=mask, scale=attn.scaling, enable_gqa=K.shape[1] != q.shape[1]
        )

    @staticmethod
    def _dense(mlp, x):
        return F.linear(
            mlp.act_fn(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight), mlp.down_proj.weight
        )

    def _mlp(self, mlp, x, routing: list, rows: torch.Tensor | None = None):
        """The MLP's output for x[rows] (all rows when None); the router runs on every row."""
        if not hasattr(mlp, "experts"):
            return self._dense(mlp, x if rows is None else x[rows])
        weights, ids = route(mlp.gate, router_logits(mlp.gate, x))
        routing.append(ids)
        if rows is not None:
            x, ids, weights = x[rows], ids[rows], weights[rows]
        out = (self._experts_grouped_mm(mlp.experts, x, ids) * weights[..., None]).sum(dim=1)
        if hasattr(mlp, "shared_experts"):
            out = out + self._dense(mlp.shared_experts, x)
        return out

    @staticmethod
    def _experts_grouped_mm(experts, x, ids):
        """[N, k, H] unweighted outputs of each token's experts, grouped by expert through
        `F.grouped_mm` (one native call per projection)."""
        N, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum(torch.bincount(flat, minlength=experts.num_experts), 0, dtype=torch.int32)
        xs = x.index_select(0, order // k)
        gate, up = F.grouped_mm(xs, experts.gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        y = F.grouped_mm(experts.act_fn(gate) * up, experts.down_proj.transpose(-2, -1), offs=offs)
        return torch.empty_like(y).index_copy_(0, order, y).view(N, k, -1)
