"""Evaluation of mid-training: held-out bits per byte of source text, next to what `gzip -9`
and `zstd -19` achieve on the same held-out files compressed as one concatenated stream.

The model reads each file as a stream of windows (stride = half a window, so every scored token
has at least half a window of context) and pays -log2 p for every token of the text; the total
is divided by the files' UTF-8 byte count. Separator tokens between files are not scored.
"""

import gzip
import json
from pathlib import Path


def compressor_bits_per_byte(texts: list[str]) -> dict[str, float]:
    import zstandard

    data = "".join(texts).encode()
    return {
        "gzip_bits_per_byte": len(gzip.compress(data, 9)) * 8 / len(data),
        "zstd_bits_per_byte": len(zstandard.ZstdCompressor(level=19).compress(data)) * 8 / len(data),
    }


def model_bits_per_byte(model, tokenizer, texts: list[str], window: int, batch_size: int = 32) -> float:
    import math

    import torch
    import torch.nn.functional as F

    stride = window // 2
    # (input window, first scored position) pairs across all files, batched for speed
    jobs: list[tuple[list[int], int]] = []
    total_bytes = 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        total_bytes += len(text.encode())
        start = 0
        while True:
            chunk = ids[start : start + window + 1]
            first = 0 if start == 0 else window - stride
            jobs.append((chunk, first))
            if start + window + 1 >= len(ids):
                break
            start += stride
    nll = 0.0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(jobs), batch_size):
            group = jobs[i : i + batch_size]
            width = max(len(c) for c, _ in group)
            batch = torch.full((len(group), width), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros(len(group), width - 1, dtype=torch.bool)
            for r, (chunk, first) in enumerate(group):
                batch[r, : len(chunk)] = torch.tensor(chunk)
                mask[r, first : len(chunk) - 1] = True
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits.float()
            losses = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="none")
            nll += losses[mask.flatten()].sum().item()
    # the first token of each file has no prediction; charge it at a uniform 1/vocab
    nll += len(texts) * math.log(len(tokenizer))
    return nll / math.log(2) / total_bytes


def evaluate(checkpoint: str | Path, config_path: str | None = None, window: int = 0) -> dict:
    from strop.config import from_dict, load_config
    from strop.data.corpus import load_corpus
    from strop.data.tokenizer import load_tokenizer
    from strop.model.policy import load_model

    ckpt = Path(checkpoint)
    model = load_model(ckpt)
    tokenizer = load_tokenizer(ckpt)
    if config_path:
        cfg = load_config(config_path)
    else:
        sidecar = ckpt / "strop.json"
        saved = json.loads(sidecar.read_text()).get("config") if sidecar.is_file() else None
        cfg = from_dict({"data": (saved or {}).get("data", {})})
    corpus = load_corpus(cfg.data)
    texts = [d.text for d in corpus.val]
    window = window or cfg.data.seq_len
    return {
        "val_files": len(texts),
        "val_bytes": sum(len(t.encode()) for t in texts),
        "window": window,
        "val_bits_per_byte": model_bits_per_byte(model, tokenizer, texts, window),
        **compressor_bits_per_byte(texts),
    }
