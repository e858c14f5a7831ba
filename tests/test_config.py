"""Config loading refuses bad input by key name; overrides parse as TOML literals."""

import pytest

from strop.config import Config, load_config, to_toml
from strop.errors import UserError


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[midtrain]\nsteps = 7\n[data]\ndirs = ["a", "b"]\n')
    cfg = load_config(f, ["midtrain.lr=0.5", "run.name=abc", "model.arch=deepseek_v3"])
    assert isinstance(cfg, Config)
    assert (cfg.midtrain.steps, cfg.midtrain.lr, cfg.run.name, cfg.data.dirs) == (7, 0.5, "abc", ["a", "b"])
    assert cfg.model.arch == "deepseek_v3"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["midtrain.stepz=3"], "midtrain.stepz"),
        (["nosection.x=1"], "nosection"),
        (['midtrain.steps="ten"'], "midtrain.steps"),
        (["midtrain.steps=0"], "must be >="),
        (["midtrain.lr=true"], "midtrain.lr"),
        (["model.arch=llama"], "model.arch"),
        (["data.dirs=3"], "data.dirs"),
        (["novalue"], "key=value"),
        (["rl.lr=inf"], "rl.lr.*not a finite number"),
        (["rl.lr=nan"], "rl.lr.*not a finite number"),
        (["rollout.temperature=-inf"], "not a finite number"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(UserError, match=message if ".*" in message else message.replace(".", r"\.")):
        load_config(None, overrides)


def test_bad_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nname=")
    with pytest.raises(UserError, match="not valid TOML"):
        load_config(bad)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('[run]\nname = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8"):
        load_config(latin1)
    with pytest.raises(UserError, match="is a directory"):
        load_config(tmp_path)


def test_toml_roundtrip(tmp_path):
    cfg = load_config(None, ["data.dirs=['x']", "run.name=r"])
    f = tmp_path / "out.toml"
    f.write_text(to_toml(cfg))
    assert load_config(f) == cfg


def test_the_sandbox_limits_are_config_keys_and_a_task_amends_them():
    """rollout.memory_mb and the others set every episode's sandbox and its checks; a task's own
    memory_mb (cpu_s, timeout_s) wins for that task. A check under too little memory says so."""
    from dataclasses import fields, replace

    from strop.env.grading.checker import task_limits
    from strop.env.sandbox.interface import Limits
    from strop.env.task import Task
    from strop.rl.rollout import sandbox_limits, score_changes

    defaults = sandbox_limits(load_config().rollout)
    assert {f.name: getattr(defaults, f.name) for f in fields(Limits) if f.name != "timeout_s"} == {
        f.name: getattr(Limits(), f.name) for f in fields(Limits) if f.name != "timeout_s"
    }
    limits = sandbox_limits(load_config(None, ["rollout.memory_mb=8", "rollout.workspace_mb=9"]).rollout)
    assert (limits.memory_mb, limits.workspace_mb) == (8, 9)
    tests = {"tests/test_m.py": "from m import f\n\n\ndef test_f():\n    assert f() == 1\n"}
    task = Task(
        id="t", suite="", split="eval", instruction="", files={"m.py": "def f():\n    return 0\n"}, hidden_tests=tests
    )
    assert task_limits(replace(task, metadata={"memory_mb": 900}), limits).memory_mb == 900
    score = score_changes(task, {"m.py": "def f():\n    return 1\n"}, limits)
    assert score.reward == 0 and "memory limit reached (memory_mb = 8)" in score.reason, score
    for mb in (16, 28, 30, 32, 34):  # cut short at start, mid-collection (an INTERNALERROR report), in a test
        score = score_changes(task, {"m.py": "def f():\n    return 1\n"}, replace(limits, memory_mb=mb))
        assert score.reward == 1 or f"memory limit reached (memory_mb = {mb})" in score.reason, (mb, score)
    assert score_changes(task, {"m.py": "def f():\n    return 1\n"}).reward == 1
