"""One RL step of the imported SmolLM2-135M-Instruct end to end (slow): rollouts in its ChatML template
with tools (examples/smol/chatml_tools.jinja) through the harness and the real checker, a trainer
step with its lower two thirds frozen (`trainer.frozen_layers`), a weight version published to the
engine. The tiny recipe's RL settings: every stage runs on the real model, whatever its rewards."""

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
    template = REPO / "examples" / "smol" / "chatml_tools.jinja"
    argv += [
        "--set",
        "rl.steps=1",
        "--set",
        f"harness.chat_template={template}",
        "--set",
        "trainer.frozen_layers=0.6667",
    ]
    assert main(argv) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(s for s in steps if s.get("step") == 1)
    assert first["version"] == 1 and first["samples"] > 0 and first["gen_tokens"] > 0
    assert (out / "model" / "config.json").is_file()
    assert json.loads((out / "model" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    from safetensors import safe_open

    frozen = "model.layers.0.mlp.down_proj.weight"
    with (
        safe_open(smollm2_dir / "model.safetensors", "pt") as a,
        safe_open(out / "model" / "model.safetensors", "pt") as b,
    ):
        assert a.get_tensor(frozen).float().equal(b.get_tensor(frozen).float())
