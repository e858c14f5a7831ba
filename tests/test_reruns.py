"""Reruns are what they say: a run directory records the config it was made with; `strop train`
rerun under another config is refused with what changed (`--resume` and `--force` say what they
do), a refused train leaves nothing behind, and a run killed before its first checkpoint starts
its metrics again instead of repeating step 1."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from strop.config import load_config, to_dict
from strop.outputs import OUTPUT_MARKER, claim_dir, record_config
from strop.rl.orchestrator import Orchestrator
from tests.test_orchestrator import TASKS, Killed, SimRuntime, config, rows


@pytest.fixture
def policy(tmp_path):
    """A directory that passes for a model until it is loaded: refusals come before any load."""
    p = tmp_path / "policy"
    p.mkdir()
    (p / "config.json").write_text("{not json")
    (p / "model.safetensors").write_bytes(b"garbage")
    return p


def train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "strop.cli", "train", *args], capture_output=True, text=True, timeout=300
    )


def finished_run(out, policy, overrides: list[str]) -> dict[str, bytes]:
    """`out` as `strop train --policy POLICY --set OVERRIDES` leaves it when finished; its files."""
    claim_dir(out, "train")
    cfg = load_config(None, overrides)
    record_config(out, {"mode": "async", "policy": os.path.realpath(policy), **to_dict(cfg)})
    (out / "result.json").write_text(json.dumps({"mode": "async", "steps": 1, "reward": 0.25}))
    return {p.name: p.read_bytes() for p in out.iterdir()}


def one_line(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


def test_a_finished_run_under_another_config_is_refused_with_what_changed(tmp_path, policy):
    """The issue's reproduction: a finished run rerun with a changed config printed the old result."""
    out = tmp_path / "rl"
    base = ["rl.steps=1", "run.threads=1"]
    files = finished_run(out, policy, base)
    common = ["--policy", str(policy), "--out", str(out), "--set", "run.threads=1"]
    same = train(*common, "--set", "rl.steps=1")
    assert same.returncode == 0 and json.loads(same.stdout)["reward"] == 0.25, same.stderr  # the same run: reported
    line = one_line(train(*common, "--set", "rl.steps=2", "--set", "rl.lr=2e-5"))
    assert "rl.steps 1 -> 2" in line and "rl.lr 0.0001 -> 2e-05" in line and "--resume" in line and "--force" in line
    assert "model.num_layers 4 -> 2" in one_line(train(*common, "--set", "rl.steps=1", "--set", "model.num_layers=2"))
    assert "mode" in one_line(train(*common, "--set", "rl.steps=1", "--mode", "sync"))
    # where and how a run is seen is no change: another thread count reports it
    assert train(*common, "--set", "rl.steps=1", "--set", "run.threads=2").returncode == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files  # nothing rewritten by a refusal


def test_resume_and_force_say_what_they_do(tmp_path, policy):
    out = tmp_path / "rl"
    files = finished_run(out, policy, ["rl.steps=1"])
    common = ["--policy", str(policy), "--out", str(out)]
    line = one_line(train(*common, "--resume", "--set", "model.num_layers=2"))
    assert "cannot be resumed under another model" in line and "model.num_layers" in line
    # a resume the config allows goes on to load the policy (this one is not loadable): the run's
    # record and result stay as they were until the new session has started
    line = one_line(train(*common, "--resume", "--set", "rl.steps=3"))
    assert "not valid JSON" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    assert "not made by `strop train`" in one_line(train("--policy", str(policy), "--out", str(user), "--force"))
    assert (user / "notes.txt").read_text() == "mine"
    # --force deletes the finished run and starts a new one, which fails to load this policy, and
    # the failed start leaves nothing behind
    assert "not valid JSON" in one_line(train(*common, "--force", "--set", "rl.steps=2"))
    assert not out.exists()
    both = train(*common, "--resume", "--force")
    assert both.returncode == 2 and "not allowed with" in both.stderr  # one or the other


def test_a_refused_train_leaves_nothing_behind(tmp_path, policy):
    """It used to leave config.json (and the marked directory) when refused after claiming --out."""
    out = tmp_path / "new" / "deeper" / "rl"
    assert "not valid JSON" in one_line(train("--policy", str(policy), "--out", str(out)))
    assert not (tmp_path / "new").exists()
    own = claim_dir(tmp_path / "own", "train")  # an empty run of its own: kept, as it was
    assert "not valid JSON" in one_line(train("--policy", str(policy), "--out", str(own)))
    assert sorted(os.listdir(own)) == [OUTPUT_MARKER]


def test_killed_before_the_first_checkpoint_the_rerun_does_not_repeat_step_1(tmp_path):
    """SIGKILL before the first checkpoint left metrics.jsonl with step 1; the rerun wrote step 1 again."""
    cfg = config(tmp_path, steps=3, max_staleness=2)
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, ckpt_every=100))
    rt = SimRuntime(seed=6)
    orch = Orchestrator(cfg, rt, TASKS, "async", tmp_path / "rl")
    train_step = rt.train

    def dies_at_step_2(samples):
        if rt.version == 1:
            raise Killed()
        return train_step(samples)

    rt.train = dies_at_step_2
    with pytest.raises(Killed):
        orch.run()
    rt.close()
    assert [r["step"] for r in rows(tmp_path / "rl")] == [1] and not (tmp_path / "rl" / "checkpoint").exists()
    rt2 = SimRuntime(seed=7)
    orch2 = Orchestrator(cfg, rt2, TASKS, "async", tmp_path / "rl")
    assert not orch2.resume()
    orch2.run()
    rt2.close()
    assert [r["step"] for r in rows(tmp_path / "rl")] == [1, 2, 3]
