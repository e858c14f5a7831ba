"""The engine's own forward pass over a Hugging Face policy's weights, with a slot-indexed KV cache.

It reads the model's parameters in place, so a weight update applied to the model is what the
next step runs; the derived tensors (fused q/k/v, joint q/k norm weight, the C kernels' packed
projections and experts, the one-call decode step) are rebuilt by `refresh()`, which the
engine calls after every update. It mixes prefill and decode rows in one pass: a batch is a list
of segments (slot, first position, tokens); all token rows share the linear and MoE work, and
attention runs per kind (one-token decode rows together, prompts of one length together). Past
the last attention only each segment's final row feeds a logit, so the last MLP runs on those
rows alone (its router still sees every row, for the routing record). No HF cache objects.

Modes. Default: fused q/k/v GEMM, precomputed RoPE tables, fused RMSNorm, SDPA, `F.grouped_mm`
experts; in fp32 with the C kernels (`strop.engine.kernels`) a pure decode step of an MoE model
is one C call (`strop.engine.decode_step`), else one per attention block and MLP. Close to the
trainer (~1e-6 in logprob, fp32) but not bitwise. Deterministic: the HF modules' own arithmetic
(HF RMSNorm and rotary code, `strop.model.routing` routers) on `strop.model.deterministic` ops
(linear, attention, experts, sigmoid, silu); it then equals the trainer's `deterministic_mode`
forward bit for bit.
"""

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from strop.engine import kernels
from strop.engine.decode_step import DecodeStep
from strop.engine.decode_step import Layer as DecodeLayer
from strop.model import deterministic as det
from strop.model.routing import moe_blocks, route, router_logits, routing_dtype


@dataclass
class Derived:
    """Derived weights of the parameters `names` (None: all), by module id, from `Forward.prepare`."""

    names: Collection[str] | None
    fused: dict = field(default_factory=dict)
    qkv_sizes: dict = field(default_factory=dict)
    qk_norm: dict = field(default_factory=dict)
    blocked: dict = field(default_factory=dict)
    packed: dict = field(default_factory=dict)
    head: tuple = ()  # (packed head or None,) when it was rebuilt


@dataclass
class Segment:
    slot: int  # KV-cache row of the sequence
    start: int  # position of the first token
    tokens: list[int]


@dataclass
class _Plan:
    """Index tensors for one call, built once and shared by every layer."""

    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N]
    decode_rows: torch.Tensor | None  # rows that are one-token segments, or None
    decode_slots: torch.Tensor | slice | None  # their cache rows (a slice when contiguous: no copy)
    decode_pos: torch.Tensor | None  # [B, 1]
    decode_len: int
    all_decode: bool  # every row is a decode row, in order
    prefills: list[tuple[int, int, int, int]]  # (first row, tokens, slot, start position)
    ends: torch.Tensor | None  # each segment's last row (None when every row is one)
    groups: list[torch.Tensor]  # fast path: [G, n] rows of G prefills of n tokens from position 0


class Forward:
    """forward(segments) -> (last-token logits [S, V], expert ids [N, n_moe_layers, k] | None)."""

    def __init__(self, model, max_slots: int, max_len: int, deterministic: bool = False):
        self.model, self.cfg = model, model.config
        self.arch = self.cfg.model_type
        if self.arch not in ("qwen3_moe", "qwen3", "deepseek_v3"):
            raise ValueError(f"the engine does not implement the {self.arch} architecture")
        self.deterministic = deterministic
        if deterministic and self.cfg.hidden_act != "silu":
            raise ValueError(f"deterministic mode computes silu activations only, not {self.cfg.hidden_act}")
        self.lin = det.linear if deterministic else F.linear
        # The lean path: precomputed RoPE tables, joint q/k norm and rotation, batched prefill attention.
        self.fast = not deterministic and self.arch != "deepseek_v3"
        # ... and in fp32 the C kernels: fused residual+norm, q/k norm+rotation+cache write, decode attention.
        dtype = next(model.parameters()).dtype
        d = getattr(model.model.layers[0].self_attn, "head_dim", 1)
        self.native = (self.fast and dtype == torch.float32 and d % 8 == 0 and self.cfg.hidden_size % 8 == 0
                       and kernels.available())
        self.max_slots, self.max_len = max_slots, max_len
        # Deterministic attention reads whole blocks of keys; rows past a query are masked anyway.
        self.cache_len = -(-max_len // det.BLOCK) * det.BLOCK
        self.blocks = moe_blocks(model)
        self.moe_index = {id(b): i for i, b in enumerate(self.blocks)}
        self.num_experts = self.blocks[0].gate.num_experts if self.blocks else 0
        dtype = next(model.parameters()).dtype
        self.k_cache, self.v_cache = [], []
        for layer in model.model.layers:
            heads, dk, dv = self._kv_shape(layer.self_attn)
            self.k_cache.append(torch.zeros(max_slots, heads, self.cache_len, dk, dtype=dtype))
            self.v_cache.append(torch.zeros(max_slots, heads, self.cache_len, dv, dtype=dtype))
        if self.arch == "deepseek_v3":
            from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

            self._rope = m.apply_rotary_pos_emb_interleave if self.cfg.rope_interleave else m.apply_rotary_pos_emb
        else:
            from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb

            self._rope = apply_rotary_pos_emb
        if self.fast:  # cos and sin for every position, the rotate-half sign folded into sin
            with torch.no_grad():
                cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=dtype), torch.arange(self.cache_len)[None])
            half = cos.shape[-1] // 2
            sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(dtype)
            self._cos, self._sin = cos[0][:, None, :].contiguous(), (sin[0] * sign)[:, None, :].contiguous()
        self._prefixes = {id(m): f"{name}." for name, m in model.named_modules()}  # for refresh(names)
        self.refresh()

    def _kv_shape(self, attn) -> tuple[int, int, int]:
        if self.arch == "deepseek_v3":  # MLA: cache the expanded per-head keys and values
            return attn.num_heads, attn.qk_head_dim, attn.v_head_dim
        return self.cfg.num_key_value_heads, attn.head_dim, attn.head_dim

    def refresh(self, names: Collection[str] | None = None) -> None:
        """Rebuild the weights derived from the model's (fused q/k/v, the kernels' packed layouts, the
        one-call decode step); call after changing weights. `names`: the parameters that changed
        (`named_parameters` names); only their derived weights are rebuilt. None: all of them."""
        self.install(self.prepare(names))

    def prepare(self, names: Collection[str] | None = None, weights: Mapping[str, torch.Tensor] | None = None) -> Derived:
        """The derived weights of the parameters `names` (None: all), computed from `weights` (new
        values by parameter name, the model's dtype; the model's own tensors for the rest) without
        changing what this forward runs: an engine prepares an update's repacking while it keeps
        decoding, writes the new values into the model, and `install`s these at the same pause."""
        weights = weights or {}

        def get(module, attr: str) -> torch.Tensor:
            return weights.get(self._prefixes[id(module)] + attr, getattr(module, attr))

        def changed(module) -> bool:
            prefix = self._prefixes[id(module)]
            return names is None or any(n.startswith(prefix) for n in names)

        out = Derived(names)
        if self.deterministic or self.arch == "deepseek_v3":
            return out
        with torch.no_grad():
            for layer in self.model.model.layers:
                a = layer.self_attn
                if not changed(a):
                    continue
                projs = (a.q_proj, a.k_proj, a.v_proj)
                w = torch.cat([get(p, "weight") for p in projs])
                b = torch.cat([get(p, "bias") for p in projs]) if a.q_proj.bias is not None else None
                out.fused[id(a)] = (w, b)
                out.qkv_sizes[id(a)] = [p.weight.shape[0] for p in projs]
                heads, kv_heads = a.q_proj.weight.shape[0] // a.head_dim, a.k_proj.weight.shape[0] // a.head_dim
                out.qk_norm[id(a)] = torch.cat([get(a.q_norm, "weight").expand(heads, -1),
                                                get(a.k_norm, "weight").expand(kv_heads, -1)])
                if self.native and w.shape[0] % 32 == 0 and a.o_proj.weight.shape[0] % 32 == 0:  # one C call per decode block
                    o_bias = get(a.o_proj, "bias") if a.o_proj.bias is not None else None
                    out.blocked[id(a)] = ((kernels.pack_linear(w), b), (kernels.pack_linear(get(a.o_proj, "weight")), o_bias))
            for block in self.blocks:
                e = block.experts
                if changed(e) and self._kernel_fits(e):
                    out.packed[id(e)] = kernels.pack_experts(SimpleNamespace(gate_up_proj=get(e, "gate_up_proj"),
                                                                             down_proj=get(e, "down_proj")))
            if self.native and changed(self.model.lm_head):
                out.head = (kernels.pack_head(get(self.model.lm_head, "weight")),)
        return out

    def install(self, derived: Derived) -> None:
        """Make prepared derived weights the ones this forward runs (and rebuild the decode step)."""
        det.forget_conversions()  # updates may write through numpy views, unseen by version counters
        if derived.names is None:
            self._fused, self._qkv_sizes, self._packed, self._qk_norm, self._blocked = {}, {}, {}, {}, {}
            self._head = None
        for mine, new in ((self._fused, derived.fused), (self._qkv_sizes, derived.qkv_sizes), (self._qk_norm, derived.qk_norm),
                          (self._blocked, derived.blocked), (self._packed, derived.packed)):
            mine.update(new)
        if derived.head:
            (self._head,) = derived.head
        self._step = self._decode_step() if self.native else None

    def _decode_step(self) -> DecodeStep | None:
        """The one-call C decode step over every layer's weights, resolved once (nn.Module attribute
        lookups cost microseconds each, hundreds per step): None unless every layer has its attention
        block packed and a packed, softmax-routed MoE without shared experts."""
        inner, layers = self.model.model, []
        for li, layer in enumerate(inner.layers):
            a, norm, post, mlp = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm, layer.mlp
            packed = self._packed.get(id(getattr(mlp, "experts", None)))
            if id(a) not in self._blocked or packed is None or hasattr(mlp, "shared_experts"):
                return None
            norms = (norm.weight, norm.variance_epsilon, post.weight, post.variance_epsilon, self._qk_norm[id(a)],
                     a.q_norm.variance_epsilon)
            layers.append(DecodeLayer(norms, *self._blocked[id(a)], a.scaling, (self.k_cache[li], self.v_cache[li]),
                                      mlp.gate.weight, mlp.gate.top_k, mlp.gate.norm_topk_prob, packed))
        return DecodeStep(layers, inner.embed_tokens.weight, (self._cos, self._sin),
                          (inner.norm.weight, inner.norm.variance_epsilon), self._head, self.max_slots)

    def _kernel_fits(self, experts) -> bool:
        """Whether `kernels.moe_experts` computes these experts: fp32, silu, widths a multiple of 32."""
        E, I2, H = experts.gate_up_proj.shape
        return (kernels.available() and experts.gate_up_proj.dtype == torch.float32 and self.cfg.hidden_act == "silu"
                and H % 32 == 0 and I2 % 32 == 0 and I2 % 16 == 0 and not getattr(experts, "has_bias", False))

    def _norm(self, mod, x):
        """An HF RMSNorm module: itself in deterministic mode (the trainer's exact ops), else fused."""
        if self.deterministic:
            return mod(x)
        return F.rms_norm(x, mod.weight.shape, mod.weight, mod.variance_epsilon)

    def _key_len(self, n: int) -> int:
        """Keys to read for queries up to position n - 1: whole BLOCKs in deterministic mode."""
        return -(-n // det.BLOCK) * det.BLOCK if self.deterministic else n

    def _plan(self, segments: list[Segment]) -> _Plan:
        lens = [len(s.tokens) for s in segments]
        for s, n in zip(segments, lens):
            assert s.start + n <= self.max_len, "sequence longer than the KV cache"
        if all(n == 1 for n in lens):  # a pure decode step: one row per segment, no per-segment tensors
            positions = torch.tensor([s.start for s in segments])
            slots = torch.tensor([s.slot for s in segments])
            if self._step is not None:  # the C decode step reads nothing else
                return _Plan(positions, slots, None, None, None, 0, True, [], None, [])
        else:
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
            dlen = self._key_len(int(dpos.max()) + 1)
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

    @torch.inference_mode()
    def __call__(self, segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor | None]:
        plan = self._plan(segments)
        tokens = torch.tensor([t for s in segments for t in s.tokens])
        if self._step is not None and plan.all_decode:
            out, ids = self._step(tokens, plan.slots, plan.positions)
            logits = out if self._step.has_head else F.linear(out, self.model.lm_head.weight)
            return logits, ids.to(routing_dtype(self.num_experts))
        inner = self.model.model
        h = inner.embed_tokens(tokens)
        if self.native:
            logits, routing = self._native(h, plan)
            return logits, torch.stack(routing, dim=1).to(routing_dtype(self.num_experts)) if routing else None
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
            # Past the last attention only each segment's final row feeds a logit: the last MLP runs
            # on those rows alone (its router still sees every row, for the routing record).
            rows = plan.ends if li == last_layer else None
            h = (h if rows is None else h[rows]) + self._mlp(layer.mlp, x, routing, rows)
        last = self._norm(inner.norm, h)
        logits = self.lin(last, self.model.lm_head.weight)
        ids = torch.stack(routing, dim=1).to(routing_dtype(self.num_experts)) if routing else None
        return logits, ids

    def _native(self, h: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The fp32 forward on the C kernels; each MLP output is added to h by the next fused norm."""
        inner, routing, pending = self.model.model, [], None
        last_layer = len(inner.layers) - 1
        for li, layer in enumerate(inner.layers):
            attn, norm, post = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
            if plan.all_decode and id(attn) in self._blocked:
                norms = (norm.weight, norm.variance_epsilon, post.weight, post.variance_epsilon,
                         self._qk_norm[id(attn)], attn.q_norm.variance_epsilon)
                x = kernels.attn_decode_block(h, pending, norms, self._blocked[id(attn)][0], (self._cos, self._sin),
                                              plan.slots, plan.positions, (self.k_cache[li], self.v_cache[li]),
                                              self._blocked[id(attn)][1], attn.scaling)
            else:
                x = kernels.add_rmsnorm(h, pending, norm.weight, norm.variance_epsilon)
                a = self._attention_native(li, attn, x, plan)
                x = kernels.add_rmsnorm(h, a, post.weight, post.variance_epsilon)
            rows = plan.ends if li == last_layer else None  # as in __call__: the last MLP on final rows only
            if rows is not None:
                h = h[rows]
            pending = self._mlp(layer.mlp, x, routing, rows)
        last = kernels.add_rmsnorm(h, pending, inner.norm.weight, inner.norm.variance_epsilon)
        if self._head is not None:
            return kernels.head_logits(last, self._head), routing
        return F.linear(last, self.model.lm_head.weight), routing

    def _attention_native(self, li: int, attn, x: torch.Tensor, plan: _Plan) -> torch.Tensor:
        N, d = x.shape[0], attn.head_dim
        qkv = F.linear(x, *self._fused[id(attn)])
        nq, nk = (s // d for s in self._qkv_sizes[id(attn)][:2])
        kc, vc = self.k_cache[li], self.v_cache[li]
        qk = kernels.qk_rope_cache(qkv, self._qk_norm[id(attn)], self._cos, self._sin, plan.slots, plan.positions,
                                   kc, vc, nq, attn.q_norm.variance_epsilon)
        if plan.all_decode:
            out = kernels.decode_attention(qk[:, :nq], kc, vc, plan.slots, plan.positions, attn.scaling)
        else:
            out = torch.empty(N, nq, d)
            if plan.decode_rows is not None:
                r = plan.decode_rows
                out[r] = kernels.decode_attention(qk[r][:, :nq], kc, vc, plan.slots[r], plan.positions[r], attn.scaling)
            v = qkv.view(N, -1, d)[:, nq + nk :]
            for rows in plan.groups:  # prompts from position 0: causal among themselves, as in _attention
                g = qk[rows]
                qs, ks, vs = g[:, :, :nq].transpose(1, 2), g[:, :, nq:].transpose(1, 2), v[rows].transpose(1, 2)
                out[rows] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=attn.scaling,
                                                           enable_gqa=nq != nk).transpose(1, 2)
            for r0, n, slot, start in plan.prefills:
                if start > 0:  # a continuation: read its earlier keys from the cache
                    L = start + n
                    o = self._attend(attn, qk[None, r0 : r0 + n, :nq].transpose(1, 2), kc[slot : slot + 1, :, :L],
                                     vc[slot : slot + 1, :, :L], plan.positions[None, r0 : r0 + n])
                    out[r0 : r0 + n] = o[0].transpose(0, 1)
        return F.linear(out.view(N, -1), attn.o_proj.weight, attn.o_proj.bias)

    # -- attention -----------------------------------------------------------------------------

    def _qkv(self, attn, x, cos, sin):
        """q [N, H, dk], k [N, Hk, dk], v [N, Hk, dv] for token rows x [N, hidden]."""
        lin, N = self.lin, x.shape[0]
        if self.arch == "deepseek_v3":
            if attn.q_lora_rank is None:
                q = lin(x, attn.q_proj.weight)
            else:
                q = lin(self._norm(attn.q_a_layernorm, lin(x, attn.q_a_proj.weight, attn.q_a_proj.bias)), attn.q_b_proj.weight)
            q = q.view(1, N, -1, attn.qk_head_dim).transpose(1, 2)
            q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
            ckv = lin(x, attn.kv_a_proj_with_mqa.weight, attn.kv_a_proj_with_mqa.bias)
            kv_nope, k_rot = torch.split(ckv, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
            kv_nope = self._norm(attn.kv_a_layernorm, kv_nope)
            q_rot, k_rot = self._rope(q_rot, k_rot.view(1, 1, N, -1), cos, sin)
            q = torch.cat((q_pass, q_rot), dim=-1)[0].transpose(0, 1)
            kv = lin(kv_nope, attn.kv_b_proj.weight).view(N, -1, attn.qk_nope_head_dim + attn.v_head_dim)
            k_nope, v = torch.split(kv, [attn.qk_nope_head_dim, attn.v_head_dim], dim=-1)
            k = torch.empty(N, k_nope.shape[1], attn.qk_head_dim, dtype=x.dtype)
            k[..., : attn.qk_nope_head_dim] = k_nope
            k[..., attn.qk_nope_head_dim :] = k_rot[0, 0][:, None, :]
            return q, k, v
        d = attn.head_dim
        if self.fast:  # one GEMM, one norm and one rotation for q and k together
            qkv = F.linear(x, *self._fused[id(attn)]).view(N, -1, d)
            nq, nk = (s // d for s in self._qkv_sizes[id(attn)][:2])
            qk = F.rms_norm(qkv[:, : nq + nk], (d,), None, attn.q_norm.variance_epsilon) * self._qk_norm[id(attn)]
            qk = qk * cos + qk.roll(d // 2, -1) * sin
            return qk[:, :nq], qk[:, nq:], qkv[:, nq + nk :]
        if self.deterministic:
            q = lin(x, attn.q_proj.weight, attn.q_proj.bias)
            k = lin(x, attn.k_proj.weight, attn.k_proj.bias)
            v = lin(x, attn.v_proj.weight, attn.v_proj.bias)
        else:  # one GEMM for q, k and v
            q, k, v = F.linear(x, *self._fused[id(attn)]).split(self._qkv_sizes[id(attn)], dim=-1)
        q = self._norm(attn.q_norm, q.view(N, -1, d))
        k = self._norm(attn.k_norm, k.view(N, -1, d))
        v = v.reshape(N, -1, d)
        q, k = self._rope(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        return q[0].transpose(0, 1), k[0].transpose(0, 1), v

    def _attention(self, li, attn, x, cos, sin, plan: _Plan):
        q, k, v = self._qkv(attn, x, cos, sin)
        kc, vc = self.k_cache[li], self.v_cache[li]
        kc[plan.slots, :, plan.positions] = k
        vc[plan.slots, :, plan.positions] = v
        if plan.all_decode:
            out = self._attend(attn, q[:, :, None], kc[plan.decode_slots, :, : plan.decode_len],
                               vc[plan.decode_slots, :, : plan.decode_len], plan.decode_pos)[:, :, 0]
            return self.lin(out.reshape(out.shape[0], -1), attn.o_proj.weight, attn.o_proj.bias)
        out = torch.empty(q.shape[0], q.shape[1], vc.shape[-1], dtype=q.dtype)
        if plan.decode_rows is not None:
            rows, L = plan.decode_rows, plan.decode_len
            K, V = kc[plan.decode_slots, :, :L], vc[plan.decode_slots, :, :L]
            out[rows] = self._attend(attn, q[rows][:, :, None], K, V, plan.decode_pos)[:, :, 0]
        for rows in plan.groups:  # [G, n] rows of prompts starting at position 0: causal among themselves
            qs, ks, vs = (t[rows].transpose(1, 2) for t in (q, k, v))
            out[rows] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=attn.scaling,
                                                       enable_gqa=ks.shape[1] != qs.shape[1]).transpose(1, 2)
        for r0, n, slot, start in plan.prefills:
            if plan.groups and start == 0:
                continue
            L = self._key_len(start + n)
            qs = q[r0 : r0 + n].transpose(0, 1)[None]
            o = self._attend(attn, qs, kc[slot : slot + 1, :, :L], vc[slot : slot + 1, :, :L], plan.positions[None, r0 : r0 + n])
            out[r0 : r0 + n] = o[0].transpose(0, 1)
        return self.lin(out.reshape(out.shape[0], -1), attn.o_proj.weight, attn.o_proj.bias)

    def _attend(self, attn, q, K, V, q_pos):
        """q [B, H, Tq, dk] against keys K/V [B, Hk, L, *]; returns [B, H, Tq, dv]."""
        if self.deterministic:
            return det.attention(q, K, V, q_pos, attn.scaling)
        mask = torch.arange(K.shape[2])[None, None, None, :] <= q_pos[:, None, :, None]
        return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=attn.scaling, enable_gqa=K.shape[1] != q.shape[1])

    # -- MLP / MoE -------------------------------------------------------------------------------

    def _dense(self, mlp, x):
        lin, act = self.lin, det.silu if self.deterministic else mlp.act_fn
        return lin(act(lin(x, mlp.gate_proj.weight)) * lin(x, mlp.up_proj.weight), mlp.down_proj.weight)

    def _mlp(self, mlp, x, routing: list, rows: torch.Tensor | None = None):
        """The MLP's output for x[rows] (all rows when None); the router runs on every row."""
        if not hasattr(mlp, "experts"):
            return self._dense(mlp, x if rows is None else x[rows])
        logits = router_logits(mlp.gate, x, self.lin)
        weights, ids = route(mlp.gate, logits, det.sigmoid if self.deterministic else torch.sigmoid)
        routing.append(ids)
        if rows is not None:
            x, ids, weights = x[rows], ids[rows], weights[rows]
        out = self._experts(mlp.experts, x, ids, weights)
        if hasattr(mlp, "shared_experts"):
            out = out + self._dense(mlp.shared_experts, x)
        return out

    def _experts(self, experts, x, ids, weights):
        """Weighted sum of each token's expert outputs: `det.experts` in deterministic mode, else
        tokens grouped by expert through `F.grouped_mm` (one native call per projection)."""
        if self.deterministic:
            return det.experts(experts, x, ids, weights)
        packed = self._packed.get(id(experts))
        if packed is not None:  # beats F.grouped_mm on the demo model at every size: 4x at decode, ~1.3x prefill
            return kernels.moe_experts(x, ids, weights, *packed)
        return (self._experts_grouped_mm(experts, x, ids) * weights[..., None]).sum(dim=1)

    def _experts_grouped_mm(self, experts, x, ids):
        """[N, k, H] unweighted outputs of each token's experts."""
        N, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum(torch.bincount(flat, minlength=experts.num_experts), 0, dtype=torch.int32)
        xs = x.index_select(0, order // k)
        gate, up = F.grouped_mm(xs, experts.gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        y = F.grouped_mm(experts.act_fn(gate) * up, experts.down_proj.transpose(-2, -1), offs=offs)
        return torch.empty_like(y).index_copy_(0, order, y).view(N, k, -1)
