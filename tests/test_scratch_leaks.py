"""A killed `strop sandbox run` or `strop tasks check` leaves no task repository behind: SIGTERM
unwinds and removes its scratch directories at once; after SIGKILL the next strop process to start
a sandbox removes them (they are named after their owner's pid)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from strop.env.host.node_cache import node_cache

SHM = Path("/dev/shm")


def strop(*args: str, tmp: Path, **kw) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp)}  # scratch worlds go here, away from other processes' own
    return subprocess.Popen(
        [sys.executable, "-m", "strop.cli", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw
    )


def leftovers(pid: int, tmp: Path) -> list[Path]:
    # scratch worlds go to TMPDIR, or to the node cache when the sandbox account cannot enter it
    return [p for base in (tmp, SHM, node_cache() / "scratch") for p in base.glob(f"strop-*-{pid}-*")]


def wait_for(cond, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def after_kill(proc: subprocess.Popen, sig: int, tmp: Path) -> None:
    os.kill(proc.pid, sig)
    proc.wait(timeout=60)
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM, proc.stderr.read()
        assert leftovers(proc.pid, tmp) == []
        return
    assert leftovers(proc.pid, tmp), "SIGKILL: nothing could clean up yet"
    sweeper = strop("sandbox", "run", "--", "true", tmp=tmp)
    assert sweeper.wait(timeout=120) == 0
    assert leftovers(proc.pid, tmp) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_sandbox_run_leaves_no_world(tmp_path, sig):
    proc = strop("sandbox", "run", "--", "sh", "-c", "echo started; sleep 60", tmp=tmp_path)
    assert proc.stdout.readline() == b"started\n"
    assert [p.name.split("-")[1] for p in leftovers(proc.pid, tmp_path) if p.parent != SHM] == ["world"]
    after_kill(proc, sig, tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_tasks_check_leaves_no_world(tmp_path, sig):
    task, repo = "synthetic-d1-eval-0000", tmp_path / "repo"
    assert strop("tasks", "export", "--suite", "synthetic", task, str(repo), tmp=tmp_path).wait(timeout=120) == 0
    proc = strop("tasks", "check", "--suite", "synthetic", task, str(repo), tmp=tmp_path)
    wait_for(lambda: any("-world-" in p.name for p in leftovers(proc.pid, tmp_path)) or proc.poll() is not None)
    assert proc.poll() is None, "the check finished before it could be killed"
    after_kill(proc, sig, tmp_path)
