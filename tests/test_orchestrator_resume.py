"""`strop train` on a tiny MoE, killed (SIGKILL, no exit handlers) after its first checkpoint and
rerun with the same command: it resumes from the checkpoint and finishes with one metrics row per
step (slow: two process starts and real rollouts)."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import tiny_model_section

pytestmark = pytest.mark.slow

CONFIG = """
[rl]
group_size = 2
batch_groups = 1
steps = 8
max_staleness = 1

[rollout]
workers = 2
engine_batch = 4
train_tasks = 6
max_turns = 1
max_turn_tokens = 16
max_context = 1536
"""


def test_killed_trainer_resumes_from_last_checkpoint(tmp_path, tiny_tokenizer):
    from strop.model.policy import build_model, save_model

    save_model(
        build_model(dataclasses.replace(tiny_model_section(), max_positions=2048), tiny_tokenizer, seed=0),
        tiny_tokenizer,
        tmp_path / "policy",
    )
    (tmp_path / "rl.toml").write_text(CONFIG)
    out = tmp_path / "rl"
    cmd = [
        sys.executable,
        "-m",
        "strop.cli",
        "train",
        "--config",
        str(tmp_path / "rl.toml"),
        "--policy",
        str(tmp_path / "policy"),
        "--out",
        str(out),
    ]
    env = {**os.environ, "STROP_THREADS": "1"}
    first = subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.time() + 240
    while not (out / "checkpoint" / "run.json").is_file():
        assert first.poll() is None and time.time() < deadline, "no checkpoint before the run ended"
        time.sleep(0.02)  # steps of this tiny run take tens of milliseconds once rollouts flow
    os.killpg(first.pid, signal.SIGKILL)  # the trainer and everything it started, mid-step
    first.wait()
    at = json.loads((out / "checkpoint" / "run.json").read_text())["step"]
    assert 1 <= at < 8

    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert f"resumed at step {at}" in second.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["version"] for r in rows] == list(range(1, 9))
    assert json.loads((out / "result.json").read_text())["steps"] == 8
