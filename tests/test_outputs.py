"""Output paths: `strop demo --fresh` deletes only a run directory it made; files later steps trust
are written whole or not at all."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from strop.config import load_config
from strop.errors import UserError
from strop.outputs import check_output_file, claim_dir, remove_run_dir, write_atomic

REPO = Path(__file__).resolve().parents[1]


def demo(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "strop.cli", "demo", "--config", str(REPO / "examples/demo.toml"), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../x", "/abs", "-rf", ".hidden", "a\\b", "a\0b", "x" * 101])
def test_run_name_must_be_one_directory_name(name):
    with pytest.raises(UserError, match="run.name"):
        load_config(None, [f"run.name={name}"])


@pytest.mark.parametrize("name", ["", "..", "."])
def test_demo_fresh_with_a_path_as_run_name_deletes_nothing(tmp_path, name):
    """The reproduction: `--set run.name=..` deleted the parent of out_dir, `run.name=` out_dir itself."""
    out = tmp_path / "runs"
    (out / "sibling").mkdir(parents=True)
    (out / "sibling" / "summary.json").write_text("{}")
    (tmp_path / "precious.txt").write_text("keep me")
    res = demo("--fresh", "--set", f"run.out_dir={out}", "--set", f"run.name={name}")
    assert res.returncode == 2 and "Traceback" not in res.stderr and "run.name" in res.stderr, res.stderr
    assert (tmp_path / "precious.txt").read_text() == "keep me" and (out / "sibling" / "summary.json").is_file()


def test_demo_fresh_refuses_a_folder_it_did_not_make(tmp_path):
    out = tmp_path / "runs"
    (out / "mine").mkdir(parents=True)
    (out / "mine" / "thesis.tex").write_text("years of work")
    res = demo("--fresh", "--set", f"run.out_dir={out}", "--set", "run.name=mine")
    assert res.returncode == 2 and "not a strop run directory" in res.stderr, res.stderr
    assert (out / "mine" / "thesis.tex").is_file()


def test_remove_run_dir_guards(tmp_path, monkeypatch):
    out = tmp_path / "runs"
    run = out / "r"
    run.mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    (run / "midtrain").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "summary.json").write_text("{}")
    (out / "link").symlink_to(elsewhere)
    with pytest.raises(UserError, match="symbolic link"):
        remove_run_dir(out / "link", out)
    assert (elsewhere / "summary.json").is_file()
    monkeypatch.chdir(run / "midtrain")
    with pytest.raises(UserError, match="working directory"):
        remove_run_dir(run, out)
    monkeypatch.chdir(tmp_path)
    remove_run_dir(run, out)  # a run directory the demo made: removed
    assert not run.exists() and out.is_dir()
    remove_run_dir(run, out)  # nothing there: nothing to do


def test_claim_dir_never_takes_a_folder_it_did_not_make(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(UserError, match="not made by `strop train`"):
        claim_dir(model, "train")
    assert sorted(p.name for p in model.iterdir()) == ["config.json"]
    assert claim_dir(tmp_path / "new" / "rl", "train").is_dir()
    claim_dir(tmp_path / "new" / "rl", "train")  # its own: taken again (a resumed run)
    with pytest.raises(UserError, match="bench async"):
        claim_dir(tmp_path / "new" / "rl", "bench async")
    (tmp_path / "empty").mkdir()
    claim_dir(tmp_path / "empty", "train")
    with pytest.raises(UserError, match="is a file"):
        claim_dir(model / "config.json", "train")


def test_check_output_file(tmp_path):
    with pytest.raises(UserError, match="is a directory"):
        check_output_file(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        check_output_file(tmp_path / "missing" / "f.bin")
    assert check_output_file(tmp_path / "f.bin") == tmp_path / "f.bin"


def test_write_atomic_killed_mid_write_keeps_the_previous_file(tmp_path):
    """SIGKILL after the new bytes are written but before the rename: the old file stays whole,
    and the next write removes the dead writer's temporary file."""
    target = tmp_path / "delta.bin"
    target.write_bytes(b"good")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import os, time
        from strop import outputs
        def stall(fd):
            print("written", flush=True)
            time.sleep(60)
        outputs.os.fsync = stall
        outputs.write_atomic({str(target)!r}, os.urandom(1 << 20))
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert child.stdout.readline().strip() == "written"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert target.read_bytes() == b"good"
    assert len(list(tmp_path.iterdir())) == 2  # the target and the killed writer's temporary file
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new" and list(tmp_path.iterdir()) == [target]
