"""A trainer process ends with the run that started it: `close` during a call (a SIGTERM or an error
while the run waits for a step) ends it at once instead of waiting out the step, and a child that
uses `exit_with_parent` ends itself when its parent is killed outright."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from strop.config import Config
from strop.env.episode import Segment
from strop.rl.advantages import Sample
from strop.rl.orchestrator import router_replay
from strop.rl.trajectory import Trajectory

REPO = Path(__file__).resolve().parent.parent


def long_samples(n: int = 32, prompt: int = 1200, generated: int = 600) -> list[Sample]:
    """`n` samples of `prompt + generated` tokens: a step on them is many forward and backward passes."""
    samples = []
    for i in range(n):
        seg = Segment(temperature=1.0)
        seg.add_forced([(7 * i + j) % 500 + 5 for j in range(prompt)])
        seg.add_generated([(11 * i + j) % 500 + 5 for j in range(generated)], [-2.0] * generated, [0] * generated, None)
        samples.append(Sample(Trajectory("toy", f"g{i}", 0, [seg], 1.0, start_version=0), (-1.0) ** i, 1 / n, 1.0))
    return samples


def test_closing_during_a_step_ends_the_trainer_process_at_once(tmp_path, tiny_policy_dir):
    from strop.runtime.trainers import TrainerProcess

    trainer = TrainerProcess(Config(), str(tiny_policy_dir), router_replay, 0, None, str(tmp_path / "weights"))
    outcome: list = []

    def step() -> None:
        try:
            outcome.append(trainer.step(long_samples()))
        except (RuntimeError, OSError) as e:  # exited mid-step, or while the request was still being sent
            outcome.append(e)

    caller = threading.Thread(target=step, daemon=True)
    caller.start()
    while trainer._in_call != "step":  # the request is on its way: the step has not answered
        time.sleep(0.001)
    trainer.close()
    caller.join(timeout=300)  # a loaded machine is slow to get there, never wrong
    # killed mid-step (SIGTERM), not a clean exit after finishing the step nobody will read
    assert trainer.proc.exitcode == -signal.SIGTERM
    assert len(outcome) == 1 and isinstance(outcome[0], Exception), "the step was finished and answered"


def spin_after_watch() -> None:
    """A child busy with work that never asks its parent anything (as a trainer is mid-step)."""
    from strop.lifetime import exit_with_parent

    exit_with_parent()
    while True:
        pass


PARENT = """
import multiprocessing, time
from tests.test_trainer_lifetime import spin_after_watch
child = multiprocessing.get_context("spawn").Process(target=spin_after_watch)
child.start()
print(child.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_child_that_watches_its_parent_exits_when_the_parent_is_killed():
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    child = None
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.5)
        assert not _gone(child)
        parent.kill()  # SIGKILL: the parent runs no cleanup at all
        parent.wait()
        deadline = time.monotonic() + 30
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(child), "the child went on running after its parent was killed"
    finally:
        parent.kill()
        if child is not None and not _gone(child):
            os.kill(child, signal.SIGKILL)
