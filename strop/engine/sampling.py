"""Batched next-token sampling: temperature, top-p and greedy rows in one pass, no torch sort.

Why not the textbook sort-then-cumsum: on a CPU `torch.sort` of a [16, 4096] fp32 block takes
milliseconds (more than the whole decode forward of a small model), and `torch.multinomial`
draws an exponential variate per vocabulary entry. Here each row's nucleus becomes a probability
threshold — found by the C kernel's radix pass, or without a compiler from numpy's sort of the
values — and one uniform per row picks a token by inverse CDF over the kept mass in vocabulary
order.

The nucleus is the smallest set of most probable tokens whose mass reaches top_p (a token is
kept when the mass ranked strictly above it is < top_p; tokens tied with the last kept one are
kept too). Each token's logprob is under the distribution actually sampled from: temperature,
then top-p renormalised. Rows with top_p = 1 report `log_softmax(logits / T)` bit for bit, which
the deterministic mode's equality with the trainer relies on.
"""

import numpy as np
import torch

from strop import kernels


def sample(
    logits: torch.Tensor,
    temperature: list[float],
    top_p: list[float],
    generators: list[torch.Generator | None],
    shared: torch.Generator,
) -> tuple[list[int], list[float]]:
    """One token per row of `logits` [B, V] and its logprob.

    temperature 0 = greedy (argmax; its logprob is still reported under top-p at T = 1). Rows with
    a generator draw their uniform from it (per-request seeds), the rest from `shared`.
    """
    logits = logits.float()  # sampling math in fp32 whatever the serving dtype (as the trainer's logprobs)
    if any(t not in (0, 1) for t in temperature):
        logits = logits / torch.tensor([t or 1.0 for t in temperature])[:, None]
    top, u = torch.tensor(top_p, dtype=torch.float32), _uniforms(generators, shared)
    if kernels.available():
        probs = kernels.softmax(logits)
        choice, ratio = kernels.sample_top_p(probs, top, u)
    else:
        probs = torch.softmax(logits, dim=-1)
        choice, ratio = _sample_torch(probs, top, u)
    greedy = [i for i, t in enumerate(temperature) if t == 0]
    if greedy:  # the argmax is always inside the nucleus
        g = torch.tensor(greedy)
        choice[g] = logits[g].argmax(-1)
        ratio[g] = probs[g].gather(1, choice[g, None])[:, 0] / _kept_mass(probs[g], top[g])
    chosen = ratio.log()  # log(p / kept mass): exactly 0 when the nucleus is one token
    full = [i for i, p in enumerate(top_p) if p >= 1]
    if full:  # no truncation: the log-softmax itself, as the trainer computes it
        f = torch.tensor(full)
        chosen[f] = torch.log_softmax(logits[f], dim=-1).gather(1, choice[f, None])[:, 0]
    return choice.tolist(), chosen.tolist()


def _uniforms(generators: list[torch.Generator | None], shared: torch.Generator) -> torch.Tensor:
    """One uniform in (0, 1] per row, drawn as 1 - U[0, 1) (so u * kept mass lies in (0, mass] and
    the first token whose running mass reaches it has nonzero kept probability): from the row's own
    generator, else from `shared` (in row order)."""
    shared_rows = [i for i, g in enumerate(generators) if g is None]
    if len(shared_rows) == len(generators):
        return 1 - torch.rand(len(generators), generator=shared)
    u = torch.empty(len(generators))
    if shared_rows:
        u[shared_rows] = torch.rand(len(shared_rows), generator=shared)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, generator=g)
    return 1 - u


def _thresholds(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest probability inside its nucleus (0 = keep all when top_p = 1)."""
    asc = torch.from_numpy(np.sort(probs.numpy(), axis=1))
    cum = asc.cumsum(-1)
    kept = ((cum[:, -1:] - cum) < top_p[:, None]).sum(-1).clamp_(min=1)  # mass ranked above each value
    t = asc.gather(1, (asc.shape[1] - kept)[:, None])[:, 0]
    return torch.where(top_p < 1, t, 0.0)


def _kept_mass(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    return torch.where(probs >= _thresholds(probs, top_p)[:, None], probs, 0.0).sum(-1)


def _sample_torch(probs: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.sample_top_p` without a compiler: (token, p[token] / kept mass) per row."""
    kept = torch.where(probs >= _thresholds(probs, top_p)[:, None], probs, 0.0)
    cdf = kept.cumsum(-1)
    total = cdf[:, -1]
    choice = torch.searchsorted(cdf, (u * total)[:, None]).clamp_(max=cdf.shape[1] - 1)[:, 0]
    return choice, kept.gather(1, choice[:, None])[:, 0] / total
