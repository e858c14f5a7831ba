"""A task's starting repository is made once and shared read-only by its sandboxes: what one sandbox
writes no other sees, the copy never changes, a check starts from the pristine repository, and
unused copies are kept within their bounds and removed."""

import threading
from pathlib import Path

import pytest

from strop.env.grading.checker import check
from strop.env.suites import synthetic
from strop.env.world import shared_repos, task_world
from strop.env.world.patches import apply_edits
from strop.env.world.task_world import task_repository, task_sandbox

TASK = synthetic.make_task(1, "eval", 0)


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def own(monkeypatch) -> shared_repos.SharedRepositories:
    """Copies of this test's own, removed after it."""
    shared = shared_repos.SharedRepositories()
    monkeypatch.setattr(task_world, "SHARED", shared)
    yield shared
    shared.clear()


def test_sandboxes_of_a_task_share_a_copy_that_none_of_them_changes(own):
    path = TASK.metadata["path"]
    test = next(p for p in TASK.files if p.startswith("tests/"))
    with task_sandbox(TASK) as a, task_sandbox(TASK) as b:
        assert a.repo_dir == b.repo_dir  # one copy
        start = tree(a.repo_dir)
        assert start == {p: d.encode() for p, d in TASK.files.items()}
        edit = f"echo planted > new.txt && echo x >> {path} && rm {test} && mv basekit moved"
        assert a.exec(edit).exit_code == 0
        a.write_file("written.txt", "from the host")
        assert a.exec("ls").stdout.split() == ["moved", "new.txt", "tests", "written.txt"]
        assert b.exec("ls").stdout.split() == ["basekit", "tests"]
        assert b.exec("ls tests").stdout.split() == [test.split("/")[1]]
        assert b.read_file(path) == TASK.files[path].encode()
        assert tree(a.repo_dir) == start  # the shared copy itself is untouched
        # nor can sandbox code reach it on the host
        assert a.exec(f"ls -A {a.repo_dir.parent}").stdout == ""
    with task_sandbox(TASK) as c:  # the next sandbox (a check) starts from the pristine repository
        assert c.diff() == {} and c.read_file(path) == TASK.files[path].encode()
        assert c.exec("ls new.txt").exit_code != 0


def test_a_check_after_an_episode_that_wrote_sees_only_its_changes():
    fixed = apply_edits(TASK.files, TASK.metadata["reference_edits"])
    with task_sandbox(TASK) as episode:  # an episode breaks the tests and leaves files behind
        episode.exec("echo 'raise SystemExit(0)' >> basekit/__init__.py; echo junk > junk.py")
        first = check(TASK, fixed, perturbed=False)
    again = check(TASK, fixed, perturbed=False)
    assert first.reward == again.reward == 1, (first, again)


def test_copies_are_kept_within_bounds_and_removed(own, monkeypatch):
    other = synthetic.make_task(1, "eval", 1)
    with task_repository(TASK) as first:
        pass
    with task_repository(TASK) as again:
        assert again == first and first.is_dir()  # kept for the next sandbox
    monkeypatch.setattr(shared_repos, "KEPT", 1)
    with task_repository(other) as second:
        assert first.is_dir()  # in use or not, within the bound until this one is released
    assert not first.exists() and second.is_dir()  # the least recently used went
    monkeypatch.setattr(shared_repos, "KEPT_BYTES", 0)
    with task_repository(TASK) as third, task_repository(TASK) as fourth:
        assert third == fourth  # one copy for both
    assert not third.exists() and not second.exists()  # none kept now
    with task_repository(TASK) as fifth:
        own.clear()
        assert fifth.is_dir()  # a copy in use stays, but for the removal at exit
        own.clear(in_use=True)
        assert not fifth.exists()


def test_one_copy_made_for_concurrent_users_and_none_left_by_a_failure(own):
    made, barrier = [], threading.Barrier(4)

    def make(root: Path) -> None:
        made.append(root)
        root.mkdir()

    def use() -> None:
        barrier.wait()
        with own.use("k", make):
            pass

    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1

    failed = []

    def fail(root: Path) -> None:
        failed.append(root)
        root.mkdir()
        raise OSError("no space")

    with pytest.raises(OSError):
        with own.use("broken", fail):
            pass
    assert not failed[0].parent.exists()
    with own.use("broken", make) as repo:  # made again by the next user
        assert repo.is_dir() and len(made) == 2


def test_the_step_table_times_every_step_and_a_shared_copy_makes_no_world():
    from strop.bench.sandbox_steps import MODES, STEPS, step_times

    kept = shared_repos.KEPT
    table = step_times(2, busy_threads=1)
    fresh, shared = (table[m] for m in MODES)
    assert all(fresh[f"{s} p50_ms"] > 0 for s in STEPS)
    assert all(shared[f"{s} p50_ms"] == 0 for s in STEPS if s.startswith("world"))
    assert task_world.SHARED is shared_repos.SHARED and shared_repos.KEPT == kept  # restored
