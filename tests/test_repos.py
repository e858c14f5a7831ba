"""Starting repositories: a git repository at a commit (or a bundle, a directory, a tarball, an
fsspec URL) materialised once per node with modes, symlinks and binary files kept, without the
history that may hold the answer; tasks on them are checked by their FAIL_TO_PASS tests."""

import json
import os
import stat
import subprocess
import sys
import tarfile
import time

import fsspec
import pytest

from strop.env.grading.checker import check, source_changes
from strop.env.host.node_cache import node_cache
from strop.env.task import Task
from strop.env.tasks.suites import load_suite
from strop.env.world.patches import hidden_tests
from strop.env.world.repo import apply_patch, checkout
from strop.env.world.task_world import task_sandbox, workspace_changes
from strop.errors import UserError
from tests.worldkit import calc_repo, git, sources_outside  # noqa: F401


def test_a_commit_is_checked_out_once_with_modes_links_and_bytes(calc_repo):
    repo, shas = calc_repo
    t = time.perf_counter()
    tree = checkout(str(repo), shas["fix_add"])
    cold = time.perf_counter() - t
    assert (tree / "calc.py").read_text().count("a + b") == 1
    assert os.access(tree / "run.sh", os.X_OK) and (tree / "logo.bin").read_bytes() == bytes(range(256))
    assert os.readlink(tree / "calc_link.py") == "calc.py"
    assert not (tree / "README.md").exists()  # a later commit's file
    log = git("-c", "safe.directory=*", "log", "--format=%s", cwd=tree)  # owned by the sandbox account
    assert log.strip() == f"base {shas['fix_add'][:12]}"  # the one commit: no history, no future
    assert checkout(str(repo), shas["fix_add"][:10]) == tree  # a short id names the same checkout
    assert stat.S_IMODE(os.stat(tree / "calc.py").st_mode) & 0o002 == 0
    assert cold >= 0  # timed by `strop bench envs`, not here


def test_bundles_directories_tarballs_and_urls(calc_repo, tmp_path):
    repo, shas = calc_repo
    git("bundle", "create", str(tmp_path / "calc.bundle"), "--all", cwd=repo)
    bundled = checkout(str(tmp_path / "calc.bundle"), shas["initial"])
    assert (bundled / "calc.py").read_text().count("a - b") == 1
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.py").write_text("x = 1\n")
    os.symlink("/etc/passwd", plain / "host_link")  # copied as a link: inside a sandbox it resolves there
    tree = checkout(str(plain))
    assert (tree / "a.py").read_text() == "x = 1\n" and os.readlink(tree / "host_link") == "/etc/passwd"
    (plain / "a.py").write_text("x = 2\n")  # a changed directory is a new checkout
    assert (checkout(str(plain)) / "a.py").read_text() == "x = 2\n"
    with tarfile.open(tmp_path / "src.tar.gz", "w:gz") as tar:
        tar.add(plain / "a.py", arcname="pkg/a.py")
    assert (checkout(str(tmp_path / "src.tar.gz")) / "pkg" / "a.py").read_text() == "x = 2\n"
    with fsspec.open("memory://strop-test/calc.bundle", "wb") as f:  # any fsspec URL: fetched into the cache
        f.write((tmp_path / "calc.bundle").read_bytes())
    assert (checkout("memory://strop-test/calc.bundle", shas["fix_add"]) / "calc.py").read_text() == (
        (checkout(str(repo), shas["fix_add"]) / "calc.py").read_text()
    )


@pytest.mark.parametrize(
    "source, commit, why",
    [
        ("{repo}", "0" * 40, "has no commit"),
        ("{repo}", "no-such-branch", "has no commit"),
        ("{tmp}/missing", "abc", "does not exist"),
        ("{tmp}/notgit", "abc", "is not a git repository"),
    ],
)
def test_bad_repositories_are_one_line(calc_repo, tmp_path, source, commit, why):
    repo, _ = calc_repo
    (tmp_path / "notgit").mkdir()
    with pytest.raises(UserError, match=why):
        checkout(source.format(repo=repo, tmp=tmp_path), commit)
    for kind in ("repos", "git"):  # nothing half-written in the cache (by this process: others build beside it)
        assert not list((node_cache() / kind).glob(f".build-{os.getpid()}-*"))


def test_patches_apply_without_touching_the_tree(calc_repo):
    repo, shas = calc_repo
    tree = checkout(str(repo), shas["initial"])
    patch = git("diff", shas["initial"], shas["fix_add"], "--", "calc.py", cwd=repo)
    after = apply_patch(tree, patch)
    assert list(after) == ["calc.py"] and b"a + b" in after["calc.py"]
    assert b"a - b" in (tree / "calc.py").read_bytes()
    with pytest.raises(UserError, match="git apply"):
        apply_patch(tree, patch.replace("a - b", "a * b"))


def task_line(repo, shas, **extra) -> dict:
    return {
        "instance_id": "calc-fix-add",
        "problem_statement": "Fix add: it subtracted",
        "repo": str(repo),
        "base_commit": shas["initial"],
        "patch": git("diff", shas["initial"], shas["fix_add"], "--", "calc.py", cwd=repo),
        "test_patch": git("diff", shas["initial"], shas["fix_add"], "--", "tests", cwd=repo),
        "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
        "PASS_TO_PASS": ["tests/test_calc.py::test_mul"],
        **extra,
    }


def test_a_task_at_a_commit_is_checked_by_its_fail_to_pass_tests(calc_repo, tmp_path):
    repo, shas = calc_repo
    (tmp_path / "t.jsonl").write_text(json.dumps(task_line(repo, shas)) + "\n")
    (task,) = load_suite(f"jsonl:{tmp_path / 't.jsonl'}", "eval")
    gold = {p: d for p, d in apply_patch(checkout(task.repo, task.base_commit), task.gold_patch).items()}
    score = check(task, gold)
    assert (score.reward, score.passed, score.outcome) == (1.0, 2, "passed"), score
    base = check(task, {"calc.py": (checkout(task.repo, task.base_commit) / "calc.py").read_bytes() + b"\n"})
    assert (base.reward, base.passed, base.failed) == (0.0, 1, 1), base
    # the hidden test file comes from test_patch: the agent's own version of it never counts
    hacked = check(task, {"tests/test_calc.py": b"def test_add():\n    pass\n\n\ndef test_mul():\n    pass\n"})
    assert hacked.reward == 0.0 and hacked.dropped_paths == ["tests/test_calc.py"]
    with task_sandbox(task) as sb:  # the agent's world: the repository at the commit, without the tests to come
        r = sb.exec("git status --short; git log --oneline | wc -l; grep -c test_add tests/test_calc.py; ls")
        assert r.stdout.split()[:2] == ["1", "0"] and "calc.py" in r.stdout, r.stdout + r.stderr
        sb.write_file("calc.py", (checkout(task.repo, task.base_commit) / "calc.py").read_text().replace("-", "+"))
        assert list(source_changes(sb.diff())) == ["calc.py"]  # git status's index refresh is not a change


def test_tasks_check_reads_no_symlink_out_of_the_workspace(calc_repo, tmp_path):
    """`strop tasks check DIR`: a symlink in DIR to a host file is left out, not graded as code."""
    repo, shas = calc_repo
    (tmp_path / "t.jsonl").write_text(json.dumps(task_line(repo, shas)) + "\n")
    (task,) = load_suite(f"jsonl:{tmp_path / 't.jsonl'}", "eval")
    work = tmp_path / "work"
    subprocess.run([sys.executable, "-m", "strop.cli", "tasks", "export", "--suite", task.suite, task.id, str(work)])
    secret = tmp_path / "secret.py"
    secret.write_text("def add(a, b):\n    return a + b\n")
    secret.chmod(0o600)
    (work / "calc.py").unlink()
    os.symlink(secret, work / "calc.py")
    changes, skipped = workspace_changes(task, work)
    assert skipped == ["calc.py", "calc_link.py"] and not changes  # the repository's own link is left out too
    run = subprocess.run(
        [sys.executable, "-m", "strop.cli", "tasks", "check", "--suite", task.suite, task.id, str(work)],
        capture_output=True,
        text=True,
    )
    assert "reward 0" in run.stdout and "left out (not regular files): calc.py, calc_link.py" in run.stdout, (
        run.stdout + run.stderr
    )


def test_a_test_patch_that_makes_a_link_reads_nothing_through_it(calc_repo, tmp_path):
    """A test_patch creating a symbolic link to a host file: the hidden test is the link's target
    path, never the file's bytes (which the checker would write into the world)."""
    repo, shas = calc_repo
    secret = tmp_path / "secret"
    secret.write_text("SECRET\n")
    secret.chmod(0o600)
    work = tmp_path / "w"
    git("clone", "-q", str(repo), str(work))
    os.symlink(secret, work / "tests" / "test_leak.py")
    git("add", "-A", cwd=work)
    patch = git("diff", "--cached", "--binary", cwd=work)
    task = Task(id="t", suite="t", split="eval", instruction="", repo=str(repo), base_commit=shas["fix_add"],
                test_patch=patch)  # fmt: skip
    assert hidden_tests(task) == {"tests/test_leak.py": str(secret)}
    # a patch that edits a file reached through the repository's own link does not apply
    link_patch = "--- a/up/etc/hostname\n+++ b/up/etc/hostname\n@@ -1 +1 @@\n-x\n+y\n"
    (tmp_path / "plain").mkdir()
    os.symlink("/", tmp_path / "plain" / "up")
    with pytest.raises(UserError, match="git apply"):
        apply_patch(checkout(str(tmp_path / "plain")), link_patch)


def test_a_mined_test_that_is_a_link_to_a_host_file_yields_no_task_reading_it(tmp_path):
    from strop.env.tasks.mine import mine

    secret = tmp_path / "secret.py"
    secret.write_text("from m import f  # SECRET\n\n\ndef test_f():\n    assert f() == 1\n")  # a test, if it were read
    repo = tmp_path / "repo"
    repo.mkdir()
    git("init", "-q", "-b", "main", cwd=repo)
    (repo / "m.py").write_text("def f():\n    return 0\n")
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", "start", cwd=repo)
    (repo / "m.py").write_text("def f():\n    return 1\n")
    (repo / "tests").mkdir()
    os.symlink(secret, repo / "tests" / "test_leak.py")
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", "fix f", cwd=repo)
    report = mine(str(repo), tmp_path / "out.jsonl", progress=False)
    assert report["kept"] == 0 and "SECRET" not in (tmp_path / "out.jsonl").read_text()


def test_a_killed_builders_leftover_goes_with_the_next_build(tmp_path):
    stale = node_cache() / "repos" / ".build-99999999-x"  # pid 99999999: dead
    (stale / "tree" / "deep").mkdir(parents=True)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.py").write_text(str(tmp_path))  # a new checkout: a build
    checkout(str(tmp_path / "plain"))
    assert not stale.exists()
