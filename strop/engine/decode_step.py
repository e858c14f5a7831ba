"""A whole decode step of an MoE model as one C call (`decode_step` in `strop.engine.csrc_decode`).

Why: per layer the kernel-by-kernel step made four ctypes calls and a torch router projection,
each paying microseconds of argument conversion and tensor plumbing; on the demo model at batch
16 that was ~15% of a step. Here every weight the step reads is resolved to a pointer once, when
the forward refreshes its derived weights, and a step passes only its tokens, slots and positions.
"""

from dataclasses import dataclass

import torch

from strop.engine import kernels


@dataclass
class Layer:
    """What one decoder layer's decode reads; its MLP is a softmax-routed MoE."""

    norms: tuple  # (input weight, eps, post weight, eps, q/k weight [nq + nk, d], eps)
    qkv: tuple  # (blocked weight, bias or None), `kernels.pack_linear`
    o: tuple  # (blocked weight, bias or None)
    scale: float
    caches: tuple  # (k, v) [S, nk, L, d]
    router: torch.Tensor  # [E, D]
    top_k: int
    norm_topk: bool
    experts: tuple  # `kernels.pack_experts`


class DecodeStep:
    """step(tokens, slots, positions) -> (logits [N, V], or the final norm's output [N, D] when
    there is no packed head; expert ids [N, layers, K] int64) for N <= max_rows one-token rows.

    Holds the tensors it points into; build a new one whenever any of them is replaced."""

    def __init__(self, layers: list[Layer], embed: torch.Tensor, rope: tuple, norm: tuple,
                 head: torch.Tensor | None, max_rows: int):
        first = layers[0]
        _, nk, L, d = first.caches[0].shape
        D, E, K = embed.shape[1], first.router.shape[0], first.top_k
        experts = [lay.experts for lay in layers]
        bf16 = all(gu.dtype == torch.bfloat16 for gu, _ in experts)
        if not bf16:  # one storage for all layers; widening bf16 is exact, so the results are the same
            experts = [(gu.float(), dn.float()) for gu, dn in experts]
        self.width = head.shape[0] * 32 if head is not None else D  # of the output rows
        self.has_head, self.routing_shape = head is not None, (len(layers), K)
        held = []
        for lay, (gu, dn) in zip(layers, experts):
            held += [lay.norms[0], lay.qkv[0], lay.qkv[1], lay.norms[4], lay.o[0], lay.o[1], lay.norms[2],
                     *lay.caches, lay.router, gu, dn]
        held += [embed, *rope, norm[0], head]
        self._held = held  # keeps every pointed-to tensor alive
        self._ptrs = torch.tensor([0 if t is None else t.data_ptr() for t in held], dtype=torch.int64)
        vals = [v for lay in layers for v in (lay.norms[1], lay.norms[5], lay.norms[3], lay.scale)] + [norm[1]]
        self._vals = torch.tensor(vals, dtype=torch.float32)
        cfg = [len(layers), D, first.o[0].shape[1] // d, nk, d, L, E, K, int(first.norm_topk),
               experts[0][1].shape[2], int(bf16), self.width if head is not None else 0]
        self._cfg = torch.tensor(cfg, dtype=torch.int64)
        sizes = torch.empty(2, dtype=torch.int64)
        kernels.function("decode_step_scratch")(self._cfg.data_ptr(), max_rows, sizes.data_ptr())
        self._fs, self._is = torch.empty(int(sizes[0])), torch.empty(int(sizes[1]), dtype=torch.int64)
        self._fn = kernels.function("decode_step")
        self._fixed = (self._cfg.data_ptr(), self._ptrs.data_ptr(), self._vals.data_ptr())
        self._max_rows = max_rows

    def __call__(self, tokens: torch.Tensor, slots: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        N = tokens.shape[0]
        assert N <= self._max_rows and tokens.dtype == slots.dtype == positions.dtype == torch.int64
        out, ids = torch.empty(N, self.width), torch.empty(N, *self.routing_shape, dtype=torch.int64)
        self._fn(tokens.data_ptr(), slots.data_ptr(), positions.data_ptr(), N, *self._fixed, out.data_ptr(),
                 ids.data_ptr(), self._fs.data_ptr(), self._is.data_ptr())
        return out, ids
