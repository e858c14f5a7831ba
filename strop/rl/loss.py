"""The per-token policy-gradient loss with PPO-style clipping against the behavior policy and a
selectable off-policy correction. Pure torch on [B, T] tensors; no model, no batching.

With r = pi_theta / pi_behavior per generated token (behavior = the engine that sampled it, so r
carries both staleness and engine/trainer mismatch) and A the token's advantage, the objective is
PPO's clipped surrogate min(r A, clip(r, 1 - clip_low, 1 + clip_high) A): no gradient pushes r
further out of the trust region. On top of it, `correction` chooses how far-off tokens count:

- "none": as is. Note that for A < 0 the surrogate is unbounded in r.
- "tis": truncated importance sampling — a token's importance weight is capped at `tis_cap`
  (for A < 0 this is dual-clip PPO); Yao et al. 2025, "Your efficient RL framework secretly
  brings you off-policy RL training".
- "icepop": tokens with r outside [mask_low, mask_high] are masked out entirely (Ring-1T's IcePop).
- "geo_mask": a whole row (one context window) is masked out when the geometric mean of its r
  is outside [geo_low, geo_high], i.e. when the sequence as a whole drifted.

Optionally `kl_coef` adds the k3 estimate of KL(behavior || theta), (r - 1) - log r, per token,
a trust region around each step's start; and `ref_kl_coef` the k3 estimate of KL(theta || reference)
with q = pi_reference / pi_theta, (q - 1) - log q, an anchor to the warm start over the whole run.
AdamW moves every parameter about one learning rate a step whether or not the reward asks for it;
the anchor pulls back what accumulates (on 12-stage chains it kept the summaries' keys as the warm
start's, where unanchored RL lost some: README, "Long context"). The loss is sum over kept tokens
of weight * (-objective + kl_coef * k3 + ref_kl_coef * k3_ref): the weights (from
`strop.rl.advantages`) carry the algorithm's normalisation, so micro-batches simply add up.
"""

import torch

from strop.config import RLSection

# exp() of a log-ratio beyond this overflows float32 (or makes TIS compute inf/inf); such tokens are
# far outside every band anyway, and the clamp zeroes their gradient.
MAX_LOG_RATIO = 20.0


def policy_loss(
    logprobs_BT: torch.Tensor,
    behavior_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    weights_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    rl: RLSection,
    reference_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss (scalar, differentiable through `logprobs_BT`) and metrics as token means over `mask_BT`:
    clip_frac (PPO clip active: zero gradient), mask_frac (masked by the correction), trunc_frac
    (TIS weight capped), k3 (KL to behavior), ref_kl (KL to the reference, whose logprobs
    `reference_BT` holds; 0 without them), ratio_mean, plus `tokens`."""
    m = mask_BT.bool()
    log_r = torch.where(m, (logprobs_BT - behavior_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO), 0.0)
    r = log_r.exp()
    a = advantages_BT
    surrogate = torch.minimum(r * a, r.clamp(1 - rl.clip_low, 1 + rl.clip_high) * a)
    clipped = m & (((a > 0) & (r > 1 + rl.clip_high)) | ((a < 0) & (r < 1 - rl.clip_low)))
    keep = m.clone()
    truncated = torch.zeros_like(m)
    if rl.correction == "tis":
        # Scale (value and gradient) so that the effective importance weight is min(r, cap).
        surrogate = surrogate * (r.clamp(max=rl.tis_cap) / r).detach()
        truncated = m & (r > rl.tis_cap)
    elif rl.correction == "icepop":
        keep &= (r >= rl.mask_low) & (r <= rl.mask_high)
    elif rl.correction == "geo_mask":
        seq_log_r = log_r.sum(-1) / m.sum(-1).clamp(min=1)  # masked positions hold log r = 0
        geo_mean = seq_log_r.exp()
        keep &= ((geo_mean >= rl.geo_low) & (geo_mean <= rl.geo_high))[:, None]
    k3 = (r - 1) - log_r
    ref_kl = torch.zeros_like(k3)
    if reference_BT is not None:
        log_q = torch.where(m, (reference_BT - logprobs_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO), 0.0)
        ref_kl = (log_q.exp() - 1) - log_q
    per_token = -surrogate + rl.kl_coef * k3 + rl.ref_kl_coef * ref_kl
    loss = (per_token * weights_BT * keep).sum()

    n = int(m.sum())

    def mean(x: torch.Tensor) -> float:
        return float(x.detach()[m].float().mean()) if n else 0.0

    metrics = {
        "tokens": float(n),
        "clip_frac": mean(clipped),
        "mask_frac": mean(m & ~keep),
        "trunc_frac": mean(truncated),
        "k3": mean(k3),
        "ref_kl": mean(ref_kl),
        "ratio_mean": mean(r),
    }
    return loss, metrics
