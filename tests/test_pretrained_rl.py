"""One RL step of the imported SmolLM2-135M-Instruct end to end (slow): rollouts in its own chat
template through the harness and the real checker, a trainer step, a weight version published to
the engine. The tiny recipe's RL settings; its rewards are 0 (it makes no tool calls yet), so the
step carries no signal, but every stage runs on the real model."""

import json
import shutil
from pathlib import Path

import pytest

from strop.cli import main

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_one_rl_step_on_smollm2(smollm2_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(REPO / "examples" / "tiny.toml", tmp_path / "tiny.toml")
    out = tmp_path / "rl"
    argv = ["train", "--config", "tiny.toml", "--policy", str(smollm2_dir), "--out", str(out)]
    assert main(argv + ["--set", "rl.steps=1", "--set", "harness.tool_parser=hermes"]) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(s for s in steps if s.get("step") == 1)
    assert first["version"] == 1 and first["samples"] > 0 and first["gen_tokens"] > 0
    assert (out / "model" / "config.json").is_file()
    assert json.loads((out / "model" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
