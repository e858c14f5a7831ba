"""Held-out bits per byte: compressors give their textbook figures; the model's figure is the
exact cross-entropy of the text (checked against a direct computation for a one-window file)."""

import math

import torch
import torch.nn.functional as F

from strop.train.eval_midtrain import compressor_bits_per_byte, model_bits_per_byte


def test_compressors_on_code_and_on_random_bytes():
    code = [open(__file__).read() * 20]
    figures = compressor_bits_per_byte(code)
    assert 0 < figures["zstd_bits_per_byte"] < 1.0 and 0 < figures["gzip_bits_per_byte"] < 1.5
    noise = ["".join(chr(33 + (i * 7919 % 94)) for i in range(5000))]
    assert compressor_bits_per_byte(noise)["gzip_bits_per_byte"] < 8.5


def test_model_bits_per_byte_is_cross_entropy(tiny_moe, tiny_tokenizer):
    text = "def add(a, b):\n    return a + b\n"
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = tiny_moe(input_ids=torch.tensor([ids[:-1]])).logits[0].float()
    nll = F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item() + math.log(len(tiny_tokenizer))
    expected = nll / math.log(2) / len(text.encode())
    got = model_bits_per_byte(tiny_moe, tiny_tokenizer, [text], window=64)
    assert abs(got - expected) < 1e-4
    # a file longer than one window is scored with overlapping windows, every token once
    long = text * 12
    assert model_bits_per_byte(tiny_moe, tiny_tokenizer, [long], window=16) > 0
