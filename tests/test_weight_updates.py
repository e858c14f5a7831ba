"""`POST /weights/update` checks an update whole before touching any tensor: a refused update
(unknown name, wrong shape, NaN, older version, unreadable file) is a 400 and the served model is
exactly what it was; the documented model-directory form works for MoE checkpoints."""

import struct

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from strop.engine.endpoint import EndpointClient, EndpointError
from strop.engine.engine import Engine, load_weights_file
from strop.model.policy import build_model, load_model, save_model
from strop.policy_api import SamplingParams
from tests.conftest import served_tiny_moe, tiny_model_section

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def served(tiny_tokenizer):
    with served_tiny_moe(tiny_tokenizer, max_batch=4, max_len=128) as (url, engine):
        yield EndpointClient(url), engine


def greedy(client: EndpointClient, engine: Engine) -> list[int]:
    return client.generate(engine.tokenizer.encode(PROMPT), SamplingParams(max_tokens=8, temperature=0)).token_ids


def refused(client: EndpointClient, path, version=None) -> str:
    with pytest.raises(EndpointError) as e:
        client.update_weights(str(path), version=version)
    assert e.value.status == 400
    return e.value.message


def snapshot(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.named_tensors().items()}


def unchanged(engine: Engine, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in engine.named_tensors().items())


def test_a_refused_update_touches_no_tensor(served, tmp_path):
    """The reproduction: a zeroed embedding plus one unknown name was refused with 400 after the
    embedding had been overwritten, and every later reply was token 0."""
    client, engine = served
    before, tokens, version = snapshot(engine), greedy(client, engine), engine.version
    emb = engine.model.model.embed_tokens.weight
    cases = {
        "unknown": {"model.embed_tokens.weight": torch.zeros_like(emb), "model.no_such.weight": torch.zeros(3)},
        "shape": {"model.embed_tokens.weight": torch.zeros_like(emb), "model.norm.weight": torch.zeros(7)},
        "nan": {
            "model.embed_tokens.weight": torch.zeros_like(emb),
            "model.norm.weight": torch.full_like(engine.model.model.norm.weight, float("nan")),
        },
        "inf_after_cast": {
            "model.norm.weight": torch.full(engine.model.model.norm.weight.shape, 1e300, dtype=torch.float64)
        },
        "dtype": {"model.norm.weight": torch.ones(engine.model.model.norm.weight.shape, dtype=torch.int64)},
    }
    for name, tensors in cases.items():
        save_file(tensors, str(tmp_path / f"{name}.safetensors"))
        assert refused(client, tmp_path / f"{name}.safetensors")
        assert unchanged(engine, before), name
        assert greedy(client, engine) == tokens and engine.version == version, name


def test_versions_never_go_back(served, tmp_path):
    client, engine = served
    w = {"model.norm.weight": engine.model.model.norm.weight.detach().clone()}
    save_file(w, str(tmp_path / "w.safetensors"))
    v = engine.version
    assert client.update_weights(str(tmp_path / "w.safetensors"), version=v + 3)["version"] == v + 3
    assert "older" in refused(client, tmp_path / "w.safetensors", version=v + 1)
    r = httpx.post(client.url + "/weights/update", json={"path": str(tmp_path / "w.safetensors"), "version": -7})
    assert r.status_code == 400 and engine.version == v + 3
    assert greedy(client, engine)  # still serving


def test_unreadable_paths_all_say_the_same(served, tmp_path):
    """Missing path, directory without weights, a text file, a bad header: one 400 message each,
    the same words, so a client cannot probe which paths exist."""
    client, engine = served
    before = snapshot(engine)
    (tmp_path / "text.safetensors").write_text("hello")
    header = b'{"a":1}'
    (tmp_path / "header.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (tmp_path / "empty").mkdir()
    messages = [
        refused(client, p)
        for p in (
            "/no/such/file",
            tmp_path / "empty",
            tmp_path / "text.safetensors",
            tmp_path / "header.safetensors",
            "/etc/passwd",
        )
    ]
    assert all(m.startswith("no safetensors weights could be read at") for m in messages), messages
    assert unchanged(engine, before)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_model_directory_of_a_moe_checkpoint_loads_as_from_pretrained_does(arch, tiny_tokenizer, tmp_path):
    model = build_model(tiny_model_section(arch), tiny_tokenizer, seed=0).eval()
    other = build_model(tiny_model_section(arch), tiny_tokenizer, seed=1).eval()
    save_model(other, tiny_tokenizer, tmp_path / "m")
    reference = dict(load_model(tmp_path / "m").named_parameters())
    tensors = load_weights_file(str(tmp_path / "m"))
    assert any(".experts.gate_up_proj" in k for k in tensors)
    for name, t in tensors.items():
        if name in reference:
            assert torch.equal(t, reference[name]), name
    engine = Engine(model, tiny_tokenizer, max_batch=2, max_len=64)
    engine.update_weights(tensors=tensors, version=1).wait(30)
    for name, p in other.named_parameters():
        assert torch.equal(dict(engine.model.named_parameters())[name], p), name


def test_incomplete_experts_are_refused(tiny_tokenizer, tmp_path):
    model = build_model(tiny_model_section("qwen3_moe"), tiny_tokenizer, seed=0).eval()
    save_model(model, tiny_tokenizer, tmp_path / "m")
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(tmp_path / "partial.safetensors"))
    with pytest.raises(ValueError, match="incomplete set of experts"):
        load_weights_file(str(tmp_path / "partial.safetensors"))
