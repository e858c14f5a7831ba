"""Data: the code corpus, the byte-level BPE tokenizer and chat template, packed token streams."""
