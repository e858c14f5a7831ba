"""Build, load and save policy models as plain Hugging Face model classes.

A tiny model is a real `Qwen3MoeForCausalLM` / `DeepseekV3ForCausalLM` / `Qwen3ForCausalLM`
built from a small config; a real base loads from a local directory. Saved directories hold
config.json + safetensors + tokenizer files, so `AutoModelForCausalLM.from_pretrained(dir)`
loads them with no strop import.
"""

import json
from pathlib import Path

from strop.config import ModelSection
from strop.errors import UserError, one_line


def experts_implementation() -> str:
    """How the MoE layers run their experts in PyTorch (the trainer's forward and backward): strop's
    sorted forward (`strop.model.experts`), registered with transformers on first use. transformers'
    default, "grouped_mm", has a CPU backward that is not bitwise repeatable with 2 threads (the same
    `make demo` reached different models); "eager" is repeatable but spends a sixth to a fifth of a
    training step filling and adding full-size zero gradients per expert."""
    from strop.model.experts import NAME

    return NAME


ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",  # SmolLM2 and other dense Llama-style bases (`strop model import`)
}


def model_config(cfg: ModelSection, tokenizer):
    """A transformers config of the chosen architecture at the size in `cfg`."""
    from transformers import DeepseekV3Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    if cfg.experts_per_token > cfg.num_experts:
        raise UserError(
            f"config key 'model.experts_per_token' ({cfg.experts_per_token}) exceeds "
            f"model.num_experts ({cfg.num_experts})"
        )
    if cfg.arch == "qwen3":
        return Qwen3Config(**common, head_dim=cfg.head_dim, intermediate_size=cfg.dense_size)
    if cfg.arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.dense_size,
            moe_intermediate_size=cfg.expert_size,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token,
            norm_topk_prob=True,
            router_aux_loss_coef=cfg.router_aux_loss_coef,
        )
    # DeepSeek-V3 style: multi-head latent attention, one shared expert, sigmoid routing with groups.
    return DeepseekV3Config(
        **common,
        intermediate_size=cfg.dense_size,
        moe_intermediate_size=cfg.expert_size,
        n_routed_experts=cfg.num_experts,
        num_experts_per_tok=cfg.experts_per_token,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        routed_scaling_factor=1.0,
        q_lora_rank=None,
        kv_lora_rank=cfg.head_dim * 2,
        qk_rope_head_dim=cfg.head_dim // 2,
        qk_nope_head_dim=cfg.head_dim // 2,
        v_head_dim=cfg.head_dim,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
    )


def build_model(cfg: ModelSection, tokenizer, seed: int = 0):
    """A freshly initialised tiny model (fp32) of the configured architecture."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(
        model_config(cfg, tokenizer), dtype=torch.float32, experts_implementation=experts_implementation()
    )


def is_model_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def load_model_config(path: str | Path):
    """The Hugging Face config of a saved policy, checked as `load_model` checks it, without
    loading its weights (enough to ask `is_moe`)."""
    from transformers import AutoConfig

    p = _checked_model_dir(path)
    return AutoConfig.from_pretrained(str(p))


def load_model(path: str | Path, dtype: str = "float32"):
    """Load a saved policy (strop's or any local HF causal LM directory)."""
    import torch
    from transformers import AutoModelForCausalLM

    p = _checked_model_dir(path)
    try:
        return AutoModelForCausalLM.from_pretrained(
            str(p), dtype=getattr(torch, dtype), experts_implementation=experts_implementation()
        )
    except Exception as e:  # damaged weights or config (their loaders raise many types): the user's files, one line
        raise UserError(f"cannot load the model in {str(p)!r}: {one_line(e)}") from None


def _checked_model_dir(path: str | Path) -> Path:
    """`path` as a model directory of a supported architecture, or a UserError saying why not."""
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"checkpoint directory {str(p)!r} does not exist")
    if not is_model_dir(p):
        raise UserError(f"{str(p)!r} is not a model directory (needs config.json and *.safetensors)")
    try:
        arch = json.loads((p / "config.json").read_text()).get("architectures", ["?"])[0]
    except json.JSONDecodeError:
        raise UserError(f"{str(p / 'config.json')!r} is not valid JSON") from None
    if arch not in ARCHITECTURES.values():
        raise UserError(f"{str(p)!r} holds a {arch}; supported: {sorted(ARCHITECTURES.values())}")
    return p


def save_model(model, tokenizer, path: str | Path, extra: dict | None = None) -> None:
    """HF format (config.json + model.safetensors + tokenizer files) and a strop.json sidecar,
    replacing `path` whole (a kill mid-save leaves the previous model, see `strop.outputs.atomic_dir`)."""
    from strop.outputs import atomic_dir

    with atomic_dir(Path(path)) as p:
        model.save_pretrained(str(p))
        tokenizer.save_pretrained(str(p))
        (p / "strop.json").write_text(json.dumps(extra or {}, indent=2))


def is_moe(model) -> bool:
    """Whether a model (or its Hugging Face config) routes through experts."""
    config = getattr(model, "config", model)
    return getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None) or False


def load_balancing_loss(router_logits: tuple, top_k: int, sigmoid: bool = False, all_sum=lambda t: t.detach()):
    """Switch-style auxiliary loss, E * sum_e f_e * P_e averaged over MoE layers: f_e is the fraction
    of top-k slots sent to expert e, P_e its mean router probability. 1.0 means perfectly balanced.

    When a batch's rows are split between ranks, each passes its own rows' logits and `all_sum`
    (a sum over the ranks, without gradient): f_e and the token count are then the whole batch's,
    and each rank's loss is its rows' part of the sum in P_e, so the ranks' losses (and their
    gradients) add up to the whole batch's loss."""
    import torch

    total = 0.0
    for logits in router_logits:
        logits = logits.reshape(-1, logits.shape[-1]).float()
        probs = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
        probs = probs / probs.sum(-1, keepdim=True)
        n_experts = probs.shape[-1]
        chosen = torch.topk(probs, top_k, dim=-1).indices
        slots = all_sum(
            torch.zeros(n_experts, device=probs.device).scatter_add_(
                0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device)
            )
        )
        tokens = slots.sum() / top_k
        total = total + n_experts * (slots / slots.sum() * probs.sum(0) / tokens).sum()
    return total / max(1, len(router_logits))


def logits_at(model, input_ids, mask):
    """fp32 logits [N, vocab] of the N positions where `mask` [B, T] is True (row-major order).
    The decoder runs on every position; the output head and its softmax only where a loss needs
    them — for SFT and RL (loss on the policy's own tokens) most of the head's cost and memory."""
    hidden = model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
    return model.get_output_embeddings()(hidden[mask]).float()
