"""The byte-level BPE tokenizer: trained here on the corpus with the `tokenizers` library, saved
in Hugging Face format (tokenizer.json + tokenizer_config.json with the chat template) so plain
`AutoTokenizer.from_pretrained(dir)` loads it."""

from pathlib import Path

from strop.data.chat import CHAT_TEMPLATE, EOS, IM_END, PAD, SPECIAL_TOKENS
from strop.data.corpus import Document
from strop.errors import UserError, one_line


def train_tokenizer(docs: list[Document], vocab_size: int, sample_bytes: int):
    """Train BPE on (a prefix of) `docs`; returns a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def texts():
        used = 0
        for d in docs:
            if used >= sample_bytes:
                return
            used += len(d.text)
            yield d.text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (IM_END, PAD)],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    p = Path(path)
    if not (p / "tokenizer.json").is_file():
        raise UserError(f"{str(p)!r} has no tokenizer.json: not a strop or Hugging Face tokenizer directory")
    try:
        return AutoTokenizer.from_pretrained(str(p))
    except Exception as e:  # a damaged tokenizer.json or config (many error types): the user's files, one line
        raise UserError(f"cannot load the tokenizer in {str(p)!r}: {one_line(e)}") from None


def document_separator_id(tokenizer) -> int:
    """The token placed between packed documents."""
    return tokenizer.convert_tokens_to_ids(EOS)
