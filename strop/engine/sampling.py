"""Batched next-token sampling: temperature, top-p and greedy rows in one pass, no torch sort.

Why not the textbook sort-then-cumsum: on a CPU `torch.sort` of a [16, 4096] fp32 block takes
milliseconds (more than the whole decode forward of a small model), and `torch.multinomial`
draws an exponential variate per vocabulary entry. Here each row's nucleus becomes a probability
threshold — found by the C kernel's radix pass, or without a compiler from numpy's sort of the
values — and one uniform per row picks a token by inverse CDF over the kept mass in vocabulary
order.

Why numpy rather than torch ops: the engine samples on a thread beside rollout threads that run
Python, and every torch call gives up the GIL and waits to win it back (`strop bench
engine-threads`: ~70 such calls made a decode step 5-7x slower beside 8 busy threads). The
compiled path makes one C call that keeps the GIL and at most one torch call (the full rows'
log-softmax); the uniforms come from torch generators a block at a time (`Uniforms`), the same
values one draw per token gave, so a faster engine samples the same tokens.

The nucleus is the smallest set of most probable tokens whose mass reaches top_p (a token is
kept when the mass ranked strictly above it is < top_p; tokens tied with the last kept one are
kept too). Each token's logprob is under the distribution actually sampled from: temperature,
then top-p renormalised. Rows with top_p = 1 report `log_softmax(logits / T)` bit for bit, which
the deterministic mode's equality with the trainer relies on.
"""

import numpy as np
import torch

from strop import kernels


class Uniforms:
    """A seeded torch generator's stream of uniforms in [0, 1), drawn `BLOCK` at a time: `torch.rand`
    of a block gives the values that many one-value draws give, for one torch call a block where a
    draw per token made one a token."""

    BLOCK = 256

    def __init__(self, seed: int):
        self._generator = torch.Generator().manual_seed(seed)
        self._block: list[float] = []
        self._next = 0

    def draw(self) -> float:
        if self._next == len(self._block):
            self._block, self._next = torch.rand(self.BLOCK, generator=self._generator).tolist(), 0
        self._next += 1
        return self._block[self._next - 1]


def sample(
    logits: np.ndarray,
    temperature: list[float],
    top_p: list[float],
    generators: list[Uniforms | None],
    shared: Uniforms,
) -> tuple[list[int], list[float]]:
    """One token per row of fp32 `logits` [B, V] and its logprob.

    temperature 0 = greedy (argmax; its logprob is still reported under top-p at T = 1). Rows with
    a generator draw their uniform from it (per-request seeds), the rest from `shared`, in row order.
    """
    if any(t not in (0, 1) for t in temperature):
        logits = logits / np.array([t or 1.0 for t in temperature], np.float32)[:, None]
    top = np.array(top_p, np.float32)
    u = np.array([1.0 - (g or shared).draw() for g in generators], np.float32)  # in (0, 1]
    greedy = np.array([t == 0 for t in temperature], np.int64)
    if kernels.available():
        _, choice, ratio = kernels.sample_rows(logits, top, u, greedy)
    else:
        choice, ratio = _sample_numpy(logits, top, u, greedy)
    with np.errstate(divide="ignore"):
        chosen = np.log(ratio)  # log(p / kept mass): exactly 0 when the nucleus is one token
    full = [i for i, p in enumerate(top_p) if p >= 1]
    if full:  # no truncation: the log-softmax itself, as the trainer computes it
        rows = logits if len(full) == len(top_p) else logits[full]
        log_probs = torch.log_softmax(torch.from_numpy(np.ascontiguousarray(rows)), dim=-1).numpy()
        chosen[full] = log_probs[np.arange(len(full)), choice[full]]
    return choice.tolist(), chosen.tolist()


def _thresholds(probs: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Per row, the smallest probability inside its nucleus (0 = keep all when top_p = 1)."""
    asc = np.sort(probs, axis=1)
    cum = asc.cumsum(-1)
    kept = np.maximum(((cum[:, -1:] - cum) < top_p[:, None]).sum(-1), 1)  # mass ranked above each value
    t = asc[np.arange(len(asc)), asc.shape[1] - kept]
    return np.where(top_p < 1, t, 0.0).astype(np.float32)


def _sample_numpy(
    logits: np.ndarray, top_p: np.ndarray, u: np.ndarray, greedy: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """`kernels.sample_rows` without a compiler: (token, p[token] / kept mass) per row."""
    probs = torch.softmax(torch.from_numpy(np.ascontiguousarray(logits)), dim=-1).numpy()
    kept = np.where(probs >= _thresholds(probs, top_p)[:, None], probs, 0.0)
    cdf = kept.cumsum(-1)
    total = cdf[:, -1]
    rows = np.arange(len(probs))
    choice = np.minimum([np.searchsorted(c, t) for c, t in zip(cdf, u * total)], cdf.shape[1] - 1)
    choice = np.where(greedy != 0, logits.argmax(-1), choice)
    return choice.astype(np.int64), (kept[rows, choice] / total).astype(np.float32)
