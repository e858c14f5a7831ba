"""Engine-vs-trainer mismatch: how far the network that sampled is from the one being trained.

The trainer calls `mismatch_metrics` every step with the engine's behaviour logprobs and its own
recomputed logprobs for the same tokens (and, for MoE, both routings). All statistics are over
response tokens (where `mask` is true):

- routing_flip_rate: fraction of (position, MoE layer) decisions whose expert set differs
- mean_abs_dlogp / max_abs_dlogp: |trainer - engine| logprob
- k3: the k3 estimator of KL(engine || trainer) from engine samples, mean of (r - 1) - log r with
  r = p_trainer / p_engine (unbiased, always >= 0; Schulman, "Approximating KL divergence")
- ratio_outside_frac: fraction of tokens with r outside [0.5, 2]
- bitwise_equal_frac: fraction of tokens whose two logprobs are the same float
"""

import torch


def routing_flip_rate(engine_routing: torch.Tensor, trainer_routing: torch.Tensor) -> float:
    """[..., n_moe_layers, k] id arrays; a decision flips when the chosen set differs (order ignored)."""
    a = torch.as_tensor(engine_routing).long().sort(dim=-1).values
    b = torch.as_tensor(trainer_routing).long().sort(dim=-1).values
    assert a.shape == b.shape, f"routing shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    return float((a != b).any(dim=-1).float().mean()) if a.numel() else 0.0


def mismatch_metrics(
    engine_logprobs, trainer_logprobs, mask=None, engine_routing=None, trainer_routing=None
) -> dict[str, float]:
    """Mismatch statistics over masked tokens; logprobs are same-shaped float tensors (any shape)."""
    e = torch.as_tensor(engine_logprobs, dtype=torch.float32)
    t = torch.as_tensor(trainer_logprobs, dtype=torch.float32).detach()
    assert e.shape == t.shape, f"logprob shapes differ: {tuple(e.shape)} vs {tuple(t.shape)}"
    if mask is not None:
        m = torch.as_tensor(mask).bool()
        e, t = e[m], t[m]
    e, t = e.reshape(-1), t.reshape(-1)
    out = {"tokens": float(e.numel())}
    if e.numel() == 0:
        return out | {
            k: 0.0 for k in ("mean_abs_dlogp", "max_abs_dlogp", "k3", "ratio_outside_frac", "bitwise_equal_frac")
        }
    d = (t - e).double()
    r = d.exp()
    out.update(
        mean_abs_dlogp=float(d.abs().mean()),
        max_abs_dlogp=float(d.abs().max()),
        k3=float(((r - 1) - d).mean()),
        ratio_outside_frac=float(((r < 0.5) | (r > 2.0)).double().mean()),
        bitwise_equal_frac=float((e == t).double().mean()),
    )
    if engine_routing is not None and trainer_routing is not None:
        out["routing_flip_rate"] = routing_flip_rate(engine_routing, trainer_routing)
    return out


def recompute(model, prompt_ids: list[int], token_ids: list[int], routing=None, deterministic: bool = False):
    """The trainer's view of one completion: logprobs of `token_ids` [n] from a full-sequence forward,
    and the routing that forward chose [prompt + n - 1, n_moe_layers, k] (None for dense models).
    With `routing` the forward replays it (R3); with `deterministic` it runs batch-invariant ops."""
    from contextlib import ExitStack

    from strop.model.deterministic import deterministic_mode
    from strop.model.routing import capture_routing, moe_blocks, replay_routing, stack_routing

    ids = torch.tensor([list(prompt_ids) + list(token_ids[:-1])])
    with torch.no_grad(), ExitStack() as stack:
        if deterministic:
            stack.enter_context(deterministic_mode(model))
        if routing is not None:
            stack.enter_context(replay_routing(model, torch.as_tensor(routing)[None]))
        records = stack.enter_context(capture_routing(model))
        logits = model(ids).logits
    lp = torch.log_softmax(logits.float(), dim=-1)[0, len(prompt_ids) - 1 :]
    lp = lp.gather(1, torch.tensor(token_ids)[:, None])[:, 0]
    blocks = moe_blocks(model)
    captured = stack_routing(records, (ids.shape[1],), blocks[0].gate.num_experts) if blocks else None
    return lp, captured


def engine_vs_trainer(model, completions) -> dict[str, dict[str, float]]:
    """How far a trainer (`model`, plain forward) is from the engine that sampled `completions`
    ((prompt_ids, Generation) pairs: token ids, logprobs, the generated tokens' routing), without
    and with replaying the engine's routing at the generated tokens' positions (R3, as the RL
    trainer replays; the prompt's positions keep the trainer's own): `mismatch_metrics` of each,
    under "plain" and "replay" (routing_flip_rate only where the engine returned routing)."""
    rows = {"plain": ([], [], []), "replay": ([], [], [])}  # trainer logprobs, trainer routing, engine routing
    engine_lp = []
    for prompt_ids, gen in completions:
        n, m = len(prompt_ids) - 1, len(gen.token_ids)
        lp, own = recompute(model, prompt_ids, gen.token_ids)
        engine_lp.append(torch.tensor(gen.logprobs))
        rows["plain"][0].append(lp)
        if gen.routing is None or own is None:
            rows["replay"][0].append(lp)
            continue
        engine = torch.as_tensor(gen.routing).to(own.dtype)
        replay = own.clone()
        replay[n : n + m] = engine
        lp_replay, replayed = recompute(model, prompt_ids, gen.token_ids, routing=replay)
        for key, trainer_lp, trainer_routing in (("plain", None, own), ("replay", lp_replay, replayed)):
            if trainer_lp is not None:
                rows[key][0].append(trainer_lp)
            rows[key][1].append(trainer_routing[n : n + m])
            rows[key][2].append(engine)
    e = torch.cat(engine_lp)
    out = {}
    for key, (trainer_lp, trainer_routing, engine_routing) in rows.items():
        routed = (torch.cat(engine_routing), torch.cat(trainer_routing)) if engine_routing else (None, None)
        out[key] = mismatch_metrics(e, torch.cat(trainer_lp), engine_routing=routed[0], trainer_routing=routed[1])
    return out
