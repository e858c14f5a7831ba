"""Simulated RL weight updates, so codec results compare with published ones.

The recipe (issue 5): an fp32 master ~ N(0, 0.02²); per-element gradient g = s_i·(μ_i + ε_t)
with μ_i ~ N(0, 0.2²), ε_t ~ N(0, 1), s_i = exp(N(0, 1)); AdamW β = (0.9, 0.999), eps 1e-8,
weight decay 0.1; a bf16 snapshot (round to nearest even) after every step.
"""

import numpy as np


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns, rounding to nearest even (finite inputs)."""
    u = x.view(np.uint32)
    return ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)


def adamw_snapshots(
    n: int, lr: float, steps: int = 20, keep: tuple[int, ...] = (15, 19, 20), seed: int = 0
) -> dict[int, np.ndarray]:
    """bf16 bit patterns of the master after each step in `keep` (0 = initial weights)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.02, n).astype(np.float32)
    mu = rng.normal(0, 0.2, n).astype(np.float32)
    s = np.exp(rng.normal(0, 1, n)).astype(np.float32)
    m = np.zeros(n, np.float32)
    v = np.zeros(n, np.float32)
    out = {0: to_bf16_bits(w)} if 0 in keep else {}
    b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.1
    tmp = np.empty(n, np.float32)
    for t in range(1, steps + 1):  # in place throughout: this loop is most of `bench sync --quick`
        g = rng.standard_normal(n, dtype=np.float32)
        g += mu
        g *= s
        m *= np.float32(b1)
        np.multiply(g, np.float32(1 - b1), out=tmp)
        m += tmp
        v *= np.float32(b2)
        g *= g
        g *= np.float32(1 - b2)
        v += g
        w *= np.float32(1 - lr * wd)  # decoupled weight decay, as torch.optim.AdamW
        np.multiply(v, np.float32(1 / (1 - b2**t)), out=tmp)
        np.sqrt(tmp, out=tmp)
        tmp += np.float32(eps)
        np.divide(m, tmp, out=tmp)
        tmp *= np.float32(lr / (1 - b1**t))
        w -= tmp
        if t in keep:
            out[t] = to_bf16_bits(w)
    return out
