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


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_training_step_is_bitwise_repeatable_on_two_threads(arch, tiny_tokenizer):
    """The same forward and backward give the same gradients bit for bit, run after run, so a fixed
    amount of training reaches the same model (transformers' default grouped_mm experts did not)."""
    from dataclasses import replace

    from strop.model.policy import build_model
    from tests.conftest import tiny_model_section

    section = replace(tiny_model_section(arch), hidden_size=64, num_experts=16, experts_per_token=4, expert_size=64)
    model = build_model(section, tiny_tokenizer, seed=0).train()
    ids = torch.randint(0, len(tiny_tokenizer), (8, 192), generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = []
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            runs.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    finally:
        torch.set_num_threads(threads)
    differ = [i for run in runs[1:] for i, (a, b) in enumerate(zip(runs[0], run)) if not torch.equal(a, b)]
    assert not differ, f"{len(differ)} gradients differ between identical steps"


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_sorted_experts_match_the_eager_loop(arch, tiny_tokenizer):
    """strop's experts forward is transformers' eager loop up to summation order: the same loss and
    gradients to float32 rounding, with experts that no token chose included (their gradient 0)."""
    from strop.model.policy import build_model
    from tests.conftest import tiny_model_section

    ids = torch.randint(0, len(tiny_tokenizer), (3, 40), generator=torch.Generator().manual_seed(2))
    results = []
    for implementation in ("eager", None):
        model = build_model(tiny_model_section(arch), tiny_tokenizer, seed=0).train()
        if implementation:
            model.set_experts_implementation(implementation)
        loss = model(input_ids=ids[:, :5], labels=ids[:, :5]).loss + model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (eager_loss, eager_grads), (loss, grads) = results
    assert model.config._experts_implementation == "strop_sorted"
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)
