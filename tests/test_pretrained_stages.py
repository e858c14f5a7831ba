"""The imported SmolLM2-135M-Instruct through strop's commands (slow; skipped without `make smol`):
`strop agent` on a real git repository in the model's ChatML template with tools
(examples/smol/chatml_tools.jinja). SmolLM2 fixes nothing here: the tests assert the mechanics
(what the policy read is the template's rendering, what it wrote is what the episode keeps), not
success."""

import json
import subprocess
from pathlib import Path

import pytest

from strop.cli import main

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "examples" / "smol" / "chatml_tools.jinja"


def smol_config(path: Path, **sections: dict) -> Path:
    """A run config: the model's template with tools and the hermes parser, plus `sections`."""
    lines = ["[harness]", f'chat_template = "{TEMPLATE}"', 'tool_parser = "hermes"']
    for name, keys in sections.items():
        lines += [f"[{name}]"] + [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def buggy_repo(path: Path) -> Path:
    path.mkdir()
    (path / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (path / "test_calc.py").write_text("from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    for argv in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", *argv], cwd=path, check=True)
    return path


@pytest.mark.slow
def test_agent_runs_smollm2_in_its_template(smollm2_dir, tmp_path):
    from strop.data.tokenizer import load_tokenizer
    from strop.env.harness.tools import load_tools

    repo = buggy_repo(tmp_path / "repo")
    config = smol_config(tmp_path / "smol.toml", rollout={"max_turn_tokens": 96})
    out = tmp_path / "episode.json"
    argv = ["agent", "--repo", str(repo), "--checkpoint", str(smollm2_dir), "--config", str(config)]
    argv += ["--max-turns", "2", "--seed", "1", "--json", str(out), "Fix the bug in calc.py so the tests pass."]
    assert main(argv) == 0
    episode = json.loads(out.read_text())
    assert episode["stop_reason"] not in ("policy_error", "error")
    tokenizer = load_tokenizer(smollm2_dir)
    tokens, mask = episode["segments"][0]["input_ids"], episode["segments"][0]["loss_mask"]
    prompt = tokens[: mask.index(1)]
    # what the engine read is the template's own rendering of the first two messages, tools listed
    expected = tokenizer.apply_chat_template(
        episode["messages"][:2],
        tools=load_tools().schemas(),
        chat_template=TEMPLATE.read_text(),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert prompt == list(expected)
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    assert "# Tools\nCall a tool with <tool_call>" in tokenizer.decode(prompt)
    # token in, token out: the generated ids are kept as sampled, each stamped with the version that
    # sampled it; the first turn's reply is their text up to its end of turn
    versions = episode["segments"][0]["versions"]
    assert all((v >= 0) == bool(m) for v, m in zip(versions, mask))
    turn = mask[len(prompt) :]
    first_turn = tokens[len(prompt) : len(prompt) + (turn.index(0) if 0 in turn else len(turn))]
    reply = episode["messages"][2]
    assert reply["role"] == "assistant" and (reply.get("tool_calls") or reply.get("content"))
    text = tokenizer.decode(first_turn, skip_special_tokens=True)
    assert reply.get("tool_calls") or text.strip().startswith(reply["content"].strip())
