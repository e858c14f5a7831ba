"""The worked environment package (examples/toy_env, installed with `pip install -e` by `make setup`):
strop finds its suite and its tool by entry point; its logged sessions replay through the production
harness with the custom tool executed in a real sandbox; and (slow) `strop sft`, `strop train` and
`strop eval policy` run on it end to end with the trained policy calling the custom tool."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from strop.config import load_config
from strop.env.demonstrators.scripted import ScriptedClient
from strop.env.harness.loop import Harness, harness_config, run_task
from strop.env.harness.tools import list_tools, load_tools
from strop.env.tasks.suites import list_suites, load_suite
from strop.train.traces import read_traces

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "toy_env"
CONFIG = EXAMPLE / "config.toml"


def strop(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, "-m", "strop.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=900
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_the_package_registers_its_suite_and_tool():
    assert "toy" in list_suites() and "outline" in list_tools()
    tasks = load_suite("toy")
    assert sum(t.split == "train" for t in tasks) == 40 and sum(t.split == "eval" for t in tasks) == 8
    tools = load_tools(load_config(CONFIG).harness.tools)
    assert tools.role("outline") == "read" and "edit_file" in tools.names


def test_a_logged_session_replays_with_the_custom_tool_run_in_the_sandbox(tiny_tokenizer):
    """The first logged session, its assistant turns played back by the production harness on the
    same task: the policy's `outline` call is executed in the sandbox and its observation is the
    one the session logged."""
    cfg = load_config(CONFIG)
    harness = Harness(tiny_tokenizer, harness_config(cfg.rollout, cfg.harness))
    (session, *_) = read_traces(EXAMPLE / "sessions.jsonl", harness.tools.names)
    task = load_suite("toy", "train")[0]
    assert session[1]["content"] == task.instruction
    turns = [m for m in session if m["role"] == "assistant"]
    texts = [harness.format.assistant_text([], m, harness.schemas).removesuffix("<|im_end|>") for m in turns]
    episode, changes = run_task(harness, ScriptedClient(texts, tiny_tokenizer), task)
    assert episode.stop_reason == "submitted" and changes
    outline = episode.tool_calls[0]
    assert (outline["name"], outline["role"]) == ("outline", "read")
    assert outline["output"] == "mathx.py:1 def helper\nmathx.py:5 def clamp\ntest_mathx.py:4 def test_clamp"
    assert outline["output"] == session[3]["content"]


def test_an_unknown_tool_in_the_example_config_is_one_line(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "strop.cli", "eval", "policy", "-c", str(CONFIG), "--policy", str(tmp_path)]
        + ["--set", 'harness.tools=["coding", "outlines"]'],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "unknown tool 'outlines'" in res.stderr


@pytest.mark.slow
def test_sft_train_and_eval_on_the_package_end_to_end(tiny_tokenizer, tmp_path):
    """A small dense model warm-started on the package's logged sessions, two RL steps on its train
    tasks, and a held-out evaluation: the commands run, and the policy calls `outline`, which the
    sandbox executes: its observations are read from RL's kept rollouts and from the held-out
    episodes kept by the same evaluation run in process."""
    from strop.model.policy import build_model, save_model
    from strop.rl.evaluate import evaluate
    from strop.rl.rollout_log import RolloutLog

    save_model(build_model(load_config(CONFIG).model, tiny_tokenizer, seed=0), tiny_tokenizer, tmp_path / "base")
    common = ["-c", str(CONFIG), "--set", f"run.out_dir={tmp_path}", "--set", "run.threads=1"]
    strop("sft", *common, "--base", str(tmp_path / "base"))
    strop("train", *common, "--set", "rl.steps=2")
    policy = str(tmp_path / "toy" / "rl" / "model")
    out = strop("eval", "policy", *common, "--policy", policy, "--json", str(tmp_path / "e.json"))
    assert "solve rate" in out.stdout and json.loads((tmp_path / "e.json").read_text())["eval_episodes"] == 8
    cfg = load_config(CONFIG, [f"run.out_dir={tmp_path}"])
    evaluate(cfg, policy, rollouts=RolloutLog(tmp_path / "kept", 10))
    observations = []
    for kept in [
        *(tmp_path / "toy" / "rl" / "rollouts").glob("step_*.jsonl.gz"),
        tmp_path / "kept" / "eval_greedy.jsonl.gz",
    ]:
        for line in gzip.decompress(kept.read_bytes()).decode().splitlines():
            for window in json.loads(line)["segments"]:
                messages = window["messages"]
                for m, after in zip(messages, messages[1:]):
                    if [c["function"]["name"] for c in m.get("tool_calls") or []] == ["outline"]:
                        observations.append(after["content"])
    assert any(".py:1 def " in o for o in observations), observations[:3]
