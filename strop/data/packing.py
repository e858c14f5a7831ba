"""Packed token streams: documents tokenized once, joined with a separator token, and cut into
fixed windows. A batch is a pure function of (seed, step), so the data position of a resumed run
is just its step number."""

import numpy as np

from strop.data.corpus import Document
from strop.data.tokenizer import document_separator_id


def tokenize_documents(tokenizer, docs: list[Document], limit: int | None = None, seed: int = 0) -> np.ndarray:
    """Documents as one int32 stream, each followed by the separator token.

    With `limit`, documents are taken in a seeded random order until the stream holds at least
    `limit` tokens: a short run tokenizes only the part of a large corpus it can use.
    """
    sep = document_separator_id(tokenizer)
    order = range(len(docs)) if limit is None else np.random.default_rng(seed).permutation(len(docs))
    out: list[int] = []
    chunk = 64
    order = list(order)
    for i in range(0, len(order), chunk):
        for seq in tokenizer([docs[j].text for j in order[i : i + chunk]], add_special_tokens=False)["input_ids"]:
            out.extend(seq)
            out.append(sep)
        if limit is not None and len(out) >= limit:
            break
    return np.asarray(out, dtype=np.int32)


class PackedBatches:
    """Windows of `seq_len + 1` tokens (inputs and shifted targets) in a seeded order per epoch."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int):
        self.windows = tokens[: (len(tokens) - 1) // seq_len * seq_len + 1]
        self.n_windows = (len(self.windows) - 1) // seq_len
        if self.n_windows < batch_size:
            raise ValueError(f"only {self.n_windows} windows of {seq_len} tokens; need at least {batch_size}")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self._epoch, self._order = -1, None

    def _order_for(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
        return self._order

    def batch_at(self, step: int) -> np.ndarray:
        """(batch_size, seq_len + 1) int64 tokens for optimizer step `step` (0-based)."""
        per_epoch = self.n_windows // self.batch_size
        epoch, k = divmod(step, per_epoch)
        idx = self._order_for(epoch)[k * self.batch_size : (k + 1) * self.batch_size]
        L = self.seq_len
        return np.stack([self.windows[i * L : i * L + L + 1] for i in idx]).astype(np.int64)
