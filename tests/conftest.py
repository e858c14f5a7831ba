"""Shared fixtures: a tokenizer trained in-session on a slice of real code, and tiny models of
each supported architecture built from it. No downloads."""

import pytest
import torch

from strop.threads import set_threads

set_threads(1)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from strop.config import DataSection
    from strop.data.corpus import load_corpus
    from strop.data.tokenizer import train_tokenizer

    corpus = load_corpus(DataSection(val_files=5))
    return train_tokenizer(corpus.train[:200], vocab_size=512, sample_bytes=400_000)


def tiny_model_section(arch: str = "qwen3_moe"):
    from strop.config import ModelSection

    return ModelSection(arch=arch, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                        num_experts=8, experts_per_token=2, expert_size=16, dense_size=64, max_positions=512)


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


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory, tiny_tokenizer):
    """A saved tiny MoE policy (its tokenizer beside it) with room for 2048-token contexts."""
    import dataclasses

    from strop.model.policy import build_model, save_model

    path = tmp_path_factory.mktemp("policy")
    save_model(build_model(dataclasses.replace(tiny_model_section(), max_positions=2048), tiny_tokenizer, seed=0),
               tiny_tokenizer, path)
    return path
