"""Dense Llama-style models (SmolLM2's architecture) in strop's engine: the engine's greedy tokens
equal Hugging Face `generate`'s on the same prompts (fp32), on the default and the deterministic
path, and the C step, the op-by-op kernel forward and the trainer's deterministic forward agree bit
for bit. Fast on a tiny random Llama built here; slow on the imported SmolLM2-135M-Instruct."""

import pytest
import torch

from strop.engine.engine import Engine
from strop.engine.forward import Forward, Segment
from strop.model.deterministic import deterministic_mode
from strop.policy_api import SamplingParams


def tiny_llama(vocab: int, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = dict(
        vocab_size=vocab,
        hidden_size=96,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,  # GQA, 3 query heads per key head as in SmolLM2
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 100000.0, "factor": 2.0},  # a scaled rotary
    )
    return LlamaForCausalLM(LlamaConfig(**config | overrides)).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """HF generate's greedy tokens (an explicit attention mask: left to itself, generate masks every
    token equal to the pad id, which SmolLM2's prompts hold as their end-of-turn token)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def assert_engine_matches_hf(model, tokenizer, prompts: list[list[int]], n: int, deterministic: bool) -> None:
    engine = Engine(
        model, tokenizer, max_batch=len(prompts), max_len=max(map(len, prompts)) + n + 1, deterministic=deterministic
    )
    assert engine.forward._step is not None, "a dense Llama runs as one C step"
    greedy = SamplingParams(max_tokens=n, temperature=0, stop_token_ids=[])
    outs = engine.generate(prompts, greedy)
    differ = [i for i, (p, o) in enumerate(zip(prompts, outs)) if o.token_ids != hf_greedy(model, p, n)]
    assert differ == [], f"prompts whose greedy tokens differ from HF generate: {differ}"


@pytest.mark.parametrize("deterministic", [False, True])
def test_tiny_llama_greedy_equals_hf_generate(tiny_tokenizer, deterministic):
    model = tiny_llama(len(tiny_tokenizer))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, len(tiny_tokenizer), (int(n),), generator=g).tolist() for n in range(3, 23)]
    assert_engine_matches_hf(model, tiny_tokenizer, prompts, 16, deterministic)


def test_llama_step_op_by_op_and_trainer_agree_bitwise(tiny_tokenizer):
    """One C call per step, the kernels one by one, and the trainer's deterministic forward: the same
    bits for the same rows, whatever else is in the batch."""
    model = tiny_llama(len(tiny_tokenizer))
    ids = torch.randint(0, len(tiny_tokenizer), (2, 12), generator=torch.Generator().manual_seed(2))
    forward = Forward(model, 4, 64, deterministic=True)
    stepped, routing = forward([Segment(0, 0, ids[0].tolist()), Segment(1, 0, ids[1].tolist())])
    assert routing is None  # a dense model routes nothing
    forward._step = None  # the op-by-op kernel path
    by_ops, _ = forward([Segment(3, 0, ids[1].tolist()), Segment(2, 0, ids[0].tolist())])
    with deterministic_mode(model), torch.no_grad():
        trainer = model(ids).logits[:, -1]
    assert torch.equal(stepped, by_ops.flip(0)) and torch.equal(stepped, trainer)


def test_llama_torch_path_matches_hf(tiny_tokenizer):
    """Without the kernels (bf16 weights, no deterministic mode) the engine's torch forward runs
    Llama's attention (no q/k norm) too."""
    model = tiny_llama(len(tiny_tokenizer)).to(torch.bfloat16)
    forward = Forward(model, 2, 64)
    assert not forward.kernel_path
    ids = list(range(5, 17))
    logits, _ = forward([Segment(0, 0, ids)])
    with torch.no_grad():
        hf = model(torch.tensor([ids])).logits[0, -1].float()
    assert torch.allclose(logits[0].float(), hf, atol=0.1, rtol=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("deterministic", [False, True])
def test_smollm2_greedy_equals_hf_generate(smollm2_dir, deterministic):
    from strop.bench.pretrained import CODING_TASKS, chat_prompts
    from strop.data.tokenizer import load_tokenizer
    from strop.model.policy import load_model

    model, tokenizer = load_model(smollm2_dir), load_tokenizer(smollm2_dir)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 49152
    prompts = chat_prompts(tokenizer, len(CODING_TASKS))  # 20 coding requests in its own template
    assert_engine_matches_hf(model, tokenizer, prompts, 32, deterministic)
