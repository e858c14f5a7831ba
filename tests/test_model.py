"""Policy models of every supported architecture save in HF format and load with plain
`transformers` Auto classes (no strop import needed) and generate."""

import pytest
import torch

from strop.data.chat import render
from strop.errors import UserError
from strop.model.policy import load_model, save_model


def test_saved_model_loads_with_auto_classes(tiny_model, tiny_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    save_model(tiny_model, tiny_tokenizer, tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    for name, p in tiny_model.state_dict().items():
        assert torch.equal(p, model.state_dict()[name]), name
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "def add(a, b):"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == render([{"role": "user", "content": "def add(a, b):"}], add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]


def test_load_model_refuses_non_model_dirs(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="not a model directory"):
        load_model(tmp_path / "empty")
