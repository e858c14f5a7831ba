"""MoE routing: the router math of each supported architecture, capture of the experts a forward
chose, and router replay (R3) for training.

Replay makes the trainer's forward go through exactly the experts the engine recorded, so the
network the trainer differentiates is the network that sampled. The gate weights are still
computed from the trainer's own router logits — gathered at the recorded ids and normalised the
way the architecture does — so the router keeps receiving gradient (R3, arXiv:2510.11370).

Routing arrays are [..., n_moe_layers, top_k] small integers (uint8 when there are at most 256
experts, else int16), one row per sequence position that went through the model, ids in the
order the router's top-k returned them. That order matters: the normalising sum runs over it,
and keeping it is what makes replayed gate weights bitwise equal to the engine's.
"""

from contextlib import contextmanager
from typing import Callable

import torch


def moe_blocks(model) -> list:
    """The MoE blocks (modules with `.gate` and `.experts`) in layer order."""
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def routing_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if num_experts <= 256 else torch.int16


def _is_sigmoid_router(gate) -> bool:
    return hasattr(gate, "e_score_correction_bias")  # DeepSeek-V3 style


def router_logits(gate, x: torch.Tensor, linear: Callable | None = None) -> torch.Tensor:
    """[T, E] router logits for hidden states x [T, H] (fp32 for sigmoid routers, as the arch does)."""
    linear = linear or torch.nn.functional.linear
    if _is_sigmoid_router(gate):
        return linear(x.type(torch.float32), gate.weight.type(torch.float32))
    return linear(x, gate.weight)


def route(gate, logits: torch.Tensor, sigmoid: Callable = torch.sigmoid) -> tuple[torch.Tensor, torch.Tensor]:
    """The architecture's own choice: (weights [T, k], ids [T, k]) from logits [T, E]; mirrors the
    Hugging Face router forwards op for op so results agree bitwise. `sigmoid` replaces the
    sigmoid router's `Tensor.sigmoid` (the deterministic engine passes its batch-invariant one)."""
    if _is_sigmoid_router(gate):
        scores = sigmoid(logits)
        choice = scores + gate.e_score_correction_bias
        n_group, E = gate.num_group, gate.num_experts
        group_scores = choice.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=gate.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(-1, E)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=gate.top_k, dim=-1, sorted=False)[1]
        return sigmoid_weights(gate, scores, ids), ids
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    weights, ids = torch.topk(probs, gate.top_k, dim=-1)
    if gate.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def sigmoid_weights(gate, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A sigmoid router's gate weights: its scores [T, E] at ids [T, k], normalised and scaled."""
    w = scores.gather(1, ids)
    if gate.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * gate.routed_scaling_factor


def replay_weights(gate, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """R3 gate weights: the arch's normalisation applied to its own scores at recorded ids [T, k]."""
    if _is_sigmoid_router(gate):
        return sigmoid_weights(gate, logits.sigmoid(), ids)
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    w = probs.gather(1, ids)
    if gate.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


@contextmanager
def capture_routing(model):
    """Record the experts each MoE layer chooses. Yields a list that, after each forward, holds one
    [tokens, top_k] id tensor per MoE layer (tokens flattened batch-major); `stack_routing` turns
    it into the [..., n_moe_layers, top_k] layout."""
    records: list[torch.Tensor] = []
    handles = [
        block.gate.register_forward_hook(lambda mod, inp, out: records.append(out[2].detach().clone()))
        for block in moe_blocks(model)
    ]
    try:
        yield records
    finally:
        for h in handles:
            h.remove()


def stack_routing(records: list[torch.Tensor], shape: tuple[int, ...], num_experts: int) -> torch.Tensor:
    """Per-layer [tokens, k] records to [*shape, n_moe_layers, k] in the compact dtype."""
    ids = torch.stack(records, dim=-2)
    return ids.reshape(*shape, len(records), ids.shape[-1]).to(routing_dtype(num_experts))


@contextmanager
def replay_routing(model, routing: torch.Tensor):
    """Make the model's MoE layers route through recorded experts.

    routing: [B, T, n_moe_layers, k] (or [T, n_moe_layers, k] for one sequence) for the input_ids
    of the next forward; a position whose ids are negative has nothing recorded (a prompt or tool
    output token the engine did not sample) and takes the router's own choice in this same forward,
    so partial replay needs no second pass. Each layer must consume its slice exactly once: a second
    forward inside the context, or leaving it without one, is an error; a recomputation of the
    forward in the backward pass (activation checkpointing, with the backward run inside the context)
    replays the same experts again. A gate with a
    `route_at(x, ids) -> (logits, weights)` attribute (set by
    `strop.model.deterministic.deterministic_mode`) computes the replayed weights with it; the
    gate's forward in place before is back on exit.
    """
    blocks = moe_blocks(model)
    assert routing.shape[-2] == len(blocks), f"routing has {routing.shape[-2]} MoE layers, model {len(blocks)}"
    flat = routing.reshape(-1, routing.shape[-2], routing.shape[-1]).long()
    used = [0] * len(blocks)

    partial = bool((flat < 0).any())

    def make_forward(i: int, gate, own: Callable):
        at = getattr(gate, "route_at", None)

        def forward(hidden_states):
            recomputed = torch._C._current_autograd_node() is not None  # called from the backward pass
            assert used[i] == 0 or recomputed, (
                f"MoE layer {i}: recorded routing consumed twice (one forward per replay context)"
            )
            used[i] += not recomputed
            x = hidden_states.reshape(-1, gate.hidden_dim)
            ids = flat[:, i]
            assert ids.shape[0] == x.shape[0], f"MoE layer {i}: {ids.shape[0]} recorded tokens for {x.shape[0]} tokens"
            assert int(ids.max()) < gate.num_experts, f"MoE layer {i}: expert id out of range"
            if partial:  # the router's own top-k where nothing was recorded, from these hidden states
                ids = torch.where(ids >= 0, ids, own(hidden_states)[2].long())
            if at is not None:
                return (*at(x, ids), ids)
            logits = router_logits(gate, x)
            return logits, replay_weights(gate, logits, ids), ids

        return forward

    before = [block.gate.__dict__.get("forward") for block in blocks]
    for i, (block, forward) in enumerate(zip(blocks, before)):
        own = forward or type(block.gate).forward.__get__(block.gate)
        block.gate.forward = make_forward(i, block.gate, own)
    try:
        yield
    finally:
        for block, forward in zip(blocks, before):
            if forward is None:
                del block.gate.forward  # back to the class's forward
            else:
                block.gate.forward = forward
    assert all(u == 1 for u in used), f"recorded routing not consumed exactly once per MoE layer: {used}"
