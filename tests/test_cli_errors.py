"""User mistakes get one clear line on stderr and exit code 2, never a traceback."""

import subprocess
import sys

import pytest


def run_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strop.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


@pytest.mark.parametrize("args, needle", [
    (["midtrain", "--set", "data.stdlib=false"], "corpus is empty"),
    (["midtrain", "--set", "data.stdlib=false", "--set", "data.dirs=['/no/such/dir']"], "does not exist"),
    (["midtrain", "--set", "midtrain.stepz=3"], "midtrain.stepz"),
    (["midtrain", "--set", "midtrain.steps=many"], "midtrain.steps"),
    (["midtrain", "-c", "/no/such.toml"], "does not exist"),
    (["eval", "midtrain", "--checkpoint", "/tmp"], "not a model directory"),
    (["eval", "policy", "--policy", "/tmp"], "no policy at"),
    (["bench", "async", "--repeats", "0"], "at least 1"),
    (["bench", "engine", "--repeats", "0"], "at least 1"),
    (["bench", "mismatch", "--repeats", "0"], "at least 1"),
    (["frobnicate"], "unknown command"),
])
def test_user_mistakes_exit_2_with_one_line(args, needle, tmp_path):
    out = run_cli(*args, "--set", f"run.out_dir={tmp_path}") if args[0] == "midtrain" else run_cli(*args)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert needle in out.stderr
    assert len([line for line in out.stderr.splitlines() if line.startswith("strop: error")]) == 1


def test_help_lists_commands():
    out = run_cli("--help")
    assert out.returncode == 0 and "midtrain" in out.stdout
