"""The served policy of the simulation: a tiny MoE warm-started here on a mixture of three replies to
"fix the bug in <file>" (`strop.online.probes`), so it samples each with a middling probability, as
RL needs (it only sharpens what a policy already does sometimes):

    scoped     one edit of the task's file                                     (`MIX["scoped"]`)
    spill      the same edit, then a second one of CHANGELOG.md, outside the task
    question   a clarifying question instead of an edit

The simulated users (`strop.online.population`) prefer one of them; nothing here knows which. The
weights are rounded to bf16 before saving, so the checkpoint equals the weight store's version 0
(bf16 snapshots) bit for bit and a rollback to 0 is exact.
"""

import random
from pathlib import Path

import torch

from strop.config import ModelSection
from strop.data.chat import GENERATION_PROMPT, render, render_message
from strop.env.episode import Segment
from strop.online.probes import EDIT_TOOL, CodingRequest, traffic_requests

MIX = {"scoped": 0.45, "spill": 0.45, "question": 0.10}
SECTION = ModelSection(
    arch="qwen3_moe",
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    num_experts=8,
    experts_per_token=2,
    expert_size=32,
    dense_size=128,
    max_positions=1024,
)


def _edit(path: str, old: str, new: str) -> dict:
    return {"function": {"name": EDIT_TOOL[0]["function"]["name"], "arguments": {"path": path, "old": old, "new": new}}}


def reply(request: CodingRequest, behaviour: str) -> str:
    """The assistant text (up to and including <|im_end|>) of one behaviour."""
    fix = _edit(request.path, "return a - b", "return a + b")
    message = {
        "scoped": {"role": "assistant", "content": "", "tool_calls": [fix]},
        "spill": {
            "role": "assistant",
            "content": "",
            "tool_calls": [fix, _edit("CHANGELOG.md", "## Unreleased", "## Unreleased\n- fixed")],
        },
        "question": {"role": "assistant", "content": f"Which function in {request.path} should I change?"},
    }[behaviour]
    return render_message(message).removeprefix(GENERATION_PROMPT).removesuffix("\n")


def demonstration(tokenizer, request: CodingRequest, behaviour: str) -> Segment:
    seg = Segment()
    seg.add_forced(tokenizer.encode(render(request.messages, EDIT_TOOL, add_generation_prompt=True)))
    ids = tokenizer.encode(reply(request, behaviour))
    seg.add_generated(ids, [0.0] * len(ids), [0] * len(ids), None)
    return seg


def warm_start(
    tokenizer,
    out_dir: str | Path,
    steps: int = 300,
    batch: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
    log=lambda line: None,
) -> Path:
    """Train the mixture policy (next-token loss on the replies only) and save it to `out_dir`."""
    from strop.model.policy import build_model, save_model
    from strop.train.sft import masked_nll

    rng = random.Random(seed)
    requests = traffic_requests()
    names, weights = list(MIX), list(MIX.values())
    model = build_model(SECTION, tokenizer, seed=seed).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))
    for step in range(steps):
        segs = [demonstration(tokenizer, rng.choice(requests), rng.choices(names, weights)[0]) for _ in range(batch)]
        loss, _ = masked_nll(model, segs, tokenizer.pad_token_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"[warm start] step {step} loss {loss.item():.3f}")
    round_to_bf16(model)
    save_model(model.eval(), tokenizer, out_dir, extra={"warm_start": {"mix": MIX, "steps": steps}})
    return Path(out_dir)


def round_to_bf16(model) -> None:
    """Round every weight to its nearest bf16 value (kept in fp32): the weights as version 0 of a weight
    store holds them and an engine serves them, so that serving the saved policy and serving version 0
    are the same thing."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
