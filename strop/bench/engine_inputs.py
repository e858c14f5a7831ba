"""What the engine benchmarks generate from: a model (a checkpoint, or a random demo-size policy)
with its tokenizer, and prompts cut from held-out standard-library code."""


def setup(checkpoint: str | None, seed: int = 0):
    """(model, tokenizer, held-out token stream): the checkpoint, or a random demo-size policy with a
    tokenizer trained here on a slice of the standard library."""
    import numpy as np

    from strop.config import DataSection, ModelSection
    from strop.data.corpus import load_corpus
    from strop.data.packing import tokenize_documents

    corpus = load_corpus(DataSection())
    if checkpoint:
        from strop.data.tokenizer import load_tokenizer
        from strop.model.policy import load_model

        model, tok = load_model(checkpoint), load_tokenizer(checkpoint)
    else:
        from strop.data.tokenizer import train_tokenizer
        from strop.model.policy import build_model

        tok = train_tokenizer(corpus.train[:300], DataSection().vocab_size, 1_500_000)
        model = build_model(ModelSection(), tok, seed=seed)
    held_out = tokenize_documents(tok, corpus.val[:12])  # prompts only need a few thousand tokens
    return model.eval(), tok, np.asarray(held_out)


def prompts_from(stream, n: int, length: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(stream) - length, n)
    return [stream[s : s + length].tolist() for s in starts]
