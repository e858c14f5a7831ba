"""The imported SmolLM2-135M-Instruct through strop's commands (slow; skipped without `make smol`):
`strop agent` on a real git repository and `strop online --simulate` in the model's ChatML template
with tools (examples/smol/chatml_tools.jinja), then `strop sync` on the online update's weights.
SmolLM2 fixes nothing here: the tests assert the mechanics (what the policy read is the template's
rendering, what it wrote is what the episode keeps, an update is gated, weights round-trip), not
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


def bits(state: dict) -> dict:
    """A safetensors state (`strop.sync.tensors`) as comparable values: name -> (dtype, shape, bytes)."""
    return {k: (t.dtype, t.shape, t.data.tobytes()) for k, t in state.items()}


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


@pytest.mark.slow
def test_online_simulation_serves_and_trains_smollm2(smollm2_dir, tmp_path, monkeypatch):
    """One simulated online cycle on SmolLM2 in its template, the lower two thirds frozen: users rate
    served replies, the update is gated and promoted or refused, the harmful update is gated too,
    and the first update is left as two bf16 versions that `strop sync` encodes and decodes exactly."""
    from strop.sync import tensors

    monkeypatch.setenv("STROP_API_KEY", "unused")  # the simulation makes its own keys
    config = smol_config(tmp_path / "smol.toml", trainer={"frozen_layers": 0.6667})
    run_dir, report_file = tmp_path / "run", tmp_path / "report.json"
    argv = ["online", "--simulate", "1", "--checkpoint", str(smollm2_dir), "--config", str(config)]
    argv += ["--requests", "16", "--gate-suites", "synthetic", "--gate-episodes", "1", "--probe-samples", "1"]
    assert main([*argv, "--run-dir", str(run_dir), "--json", str(report_file)]) == 0
    assert "chat in the template chatml_tools.jinja" in (run_dir / "serve.log").read_text()
    report = json.loads(report_file.read_text())
    cycle = report["cycles"][0]
    assert cycle["rated"] == 16 and cycle["status"] in ("promoted", "refused") and cycle["candidate"] == 1
    monitors = {"invalid_tool_call_rate", "edit_rate", "question_rate", "sycophancy_rate"}
    assert monitors | {"suite:synthetic"} == set(cycle["gates"])
    assert report["harmful"]["status"] in ("promoted", "refused")
    # promoted: the rollback to version 0 serves its weights again, bit for bit
    assert report["rollback_bitwise"] == (cycle["status"] == "promoted")

    snapshots = sorted((run_dir / "snapshots").glob("*.safetensors"))
    assert [p.name for p in snapshots] == ["00000000.safetensors", "00000001.safetensors"]
    v0, v1 = (bits(tensors.load(str(p))) for p in snapshots)
    frozen, trained = "model.layers.0.mlp.down_proj.weight", "model.layers.29.mlp.down_proj.weight"
    assert v0[frozen] == v1[frozen] and v0[trained] != v1[trained]
    delta, decoded = tmp_path / "v1.delta", tmp_path / "v1.safetensors"
    assert main(["sync", "encode", "--base", str(snapshots[0]), "--new", str(snapshots[1]), "-o", str(delta)]) == 0
    assert main(["sync", "decode", "--base", str(snapshots[0]), str(delta), "-o", str(decoded)]) == 0
    assert bits(tensors.load(str(decoded))) == v1
    # the frozen two thirds cost next to nothing (the trained third: docs/results/bench/pretrained.md)
    assert delta.stat().st_size < snapshots[1].stat().st_size / 3
