"""Task files (`jsonl:PATH`) and suites as plugins: one contract for every suite, bad lines refused
with the file, line and field."""

import json
import re
import subprocess
import sys

import pytest

from strop.env.tasks.suites import draw_tasks, get_task, list_suites, load_suite
from strop.env.tasks.task_file import TaskFileSuite, task_from_record, task_record
from strop.errors import UserError

ADD = {"m.py": "def add(a, b):\n    return a - b\n"}
TEST = {"tests/test_m.py": "from m import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n"}


def write(path, *records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return f"jsonl:{path}"


def record(i, **extra):
    return {"instance_id": f"t-{i}", "problem_statement": "make add add", "files": ADD, "hidden_tests": TEST, **extra}


def test_builtins_are_entry_points_like_a_users():
    assert set(list_suites()) >= {"synthetic", "humaneval", "mutated", "chain"}
    assert load_suite("strop.env.suites.chain", "eval", difficulty=1, limit=2) == load_suite(
        "chain", "eval", difficulty=1, limit=2
    )


def test_a_task_without_split_is_in_both(tmp_path):
    suite = write(tmp_path / "t.jsonl", record(1, split="train"), record(2), record(3, split="eval"))
    assert [t.id for t in load_suite(suite, "train")] == ["t-1", "t-2"]
    assert [t.id for t in load_suite(suite, "eval")] == ["t-2", "t-3"]
    assert get_task(suite, "t-3").split == "eval"


def test_every_suite_draws_through_one_contract(tmp_path):
    # humaneval's load takes no difficulty or limit: strop applies them (it used to refuse them)
    assert len(draw_tasks("humaneval", "train", [1], 10)) == 10
    assert len(draw_tasks("synthetic", "train", [1, 2], 3, start=1)) == 6
    suite = write(tmp_path / "t.jsonl", *(record(i, difficulty=1 + i % 2) for i in range(6)))
    assert [t.id for t in draw_tasks(suite, "eval", [2], 2, start=1)] == ["t-3", "t-5"]
    plain = write(tmp_path / "p.jsonl", *(record(i) for i in range(5)))
    assert [t.id for t in draw_tasks(plain, "train", [1, 2], 2, start=1)] == ["t-1", "t-2"]  # drawn once


def test_image_paths_start_at_the_task_file(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "img.tar").write_bytes(b"")
    task, _ = task_from_record(record(1, image="images/img.tar"), "f:1", tmp_path, "jsonl:f")
    assert task.image == str(tmp_path / "images" / "img.tar")
    assert task_record(task, tmp_path)["image"] == "images/img.tar"


def test_round_trip_and_swe_bench_fields(tmp_path):
    rec = record(
        1,
        FAIL_TO_PASS=json.dumps(["tests/test_m.py::test_add"]),
        PASS_TO_PASS="[]",
        patch="--- a/m.py\n",
        version="1.2",
        difficulty=2,
    )
    task, named = task_from_record(rec, "f:1", tmp_path, "jsonl:f")
    assert not named and task.fail_to_pass == ["tests/test_m.py::test_add"] and task.gold_patch == "--- a/m.py\n"
    assert task.metadata == {"version": "1.2", "difficulty": 2, "n_tests": 1}
    again, _ = task_from_record(task_record(task), "f:1", tmp_path, "jsonl:f")
    assert again == task


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"problem_statement": "x", "files": ADD, "hidden_tests": TEST}, "missing field 'instance_id'"),
        (record(1, FAIL_TO_PASS=3), "field 'FAIL_TO_PASS' must be a list of strings"),
        (record(1, FAIL_TO_PASS="[nope"), "field 'FAIL_TO_PASS' must be a list of strings"),
        (record(1, split="test"), 'field \'split\' must be "train" or "eval"'),
        (record(1, difficulty=True), "field 'difficulty' must be an integer"),
        (record(1, fail_to_pass=[]), "unknown field 'fail_to_pass' (did you mean 'FAIL_TO_PASS'?)"),
        (record(1, repo="no/such/dir"), "field 'repo': no repository at"),
        (record(1, image="no/such/img.tar"), "field 'image': no image at"),
        ({"instance_id": "x", "problem_statement": "x", "hidden_tests": TEST}, "a task needs a starting repository"),
        ({"instance_id": "x", "problem_statement": "x", "files": ADD}, "a task needs hidden tests"),
        ([1, 2], "a task is a JSON object"),
    ],
)
def test_bad_lines_name_the_line_and_the_field(tmp_path, bad, message):
    suite = write(tmp_path / "t.jsonl", record(0), bad)
    with pytest.raises(UserError, match=r"t\.jsonl:2: " + re.escape(message)):
        load_suite(suite)


def test_bad_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        TaskFileSuite(str(tmp_path / "none.jsonl")).load()
    (tmp_path / "dup.jsonl").write_text(json.dumps(record(1)) + "\n" + json.dumps(record(1)) + "\n")
    with pytest.raises(UserError, match="dup.jsonl:2: instance_id 't-1' appears twice"):
        load_suite(f"jsonl:{tmp_path / 'dup.jsonl'}")
    (tmp_path / "j.jsonl").write_text("{nope\n")
    with pytest.raises(UserError, match="j.jsonl:1: not valid JSON"):
        load_suite(f"jsonl:{tmp_path / 'j.jsonl'}")


def test_cli_refuses_a_bad_task_file_in_one_line(tmp_path):
    suite = write(tmp_path / "t.jsonl", record(1, FAIL_TO_PASS=[1]))
    run = subprocess.run([sys.executable, "-m", "strop.cli", "tasks", "list", "--suite", suite], capture_output=True)
    assert run.returncode == 2 and run.stderr.decode().count("\n") == 1, run.stderr
    assert b"t.jsonl:1: field 'FAIL_TO_PASS'" in run.stderr
    for name, why in (("nope.mod", b"cannot be imported"), ("nosuch", b"unknown suite")):
        run = subprocess.run([sys.executable, "-m", "strop.cli", "tasks", "list", "--suite", name], capture_output=True)
        assert run.returncode == 2 and why in run.stderr, run.stderr


def test_a_config_that_leaves_tasks_out_says_so(tmp_path, capsys):
    """Tasks whose difficulty is not in rollout.difficulties were never trained on, silently."""
    from strop.config import load_config
    from strop.rl.evaluate import eval_tasks
    from strop.runtime.rl_run import train_tasks

    suite = write(tmp_path / "t.jsonl", *(record(i, difficulty=1 + i % 3) for i in range(6)))
    some = load_config(None, [f"rollout.suite={suite}", "rollout.difficulties=[1, 2]"])
    assert [t.id for t in train_tasks(some)] == ["t-0", "t-3", "t-1", "t-4"]
    warned = capsys.readouterr().err
    assert "rollout.difficulties = [1, 2] leaves out train tasks" in warned and "difficulty 3 (2 tasks)" in warned
    none = load_config(None, [f"rollout.suite={suite}", "rollout.eval_difficulties=[4]"])
    with pytest.raises(UserError, match=r"rollout.eval_difficulties = \[4\] draws no eval tasks .* difficulty 1 \(2"):
        eval_tasks(none)
    every = load_config(None, [f"rollout.suite={suite}", "rollout.difficulties=[1, 2, 3]"])
    assert len(train_tasks(every)) == 6 and capsys.readouterr().err == ""


# ---- a task file is untrusted data -------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("repo", "/etc", "is outside the task file's directory"),
        ("repo", "../../../../../../../../etc", "is outside the task file's directory"),
        ("repo", "escape", "is outside the task file's directory"),  # a link in the file's folder, out of it
        ("image", "/etc", "is outside the task file's directory"),
        ("image", "file:///etc/shadow", "a task file fetches no URL on its own"),
        ("image", "http://169.254.169.254/latest/meta-data", "a task file fetches no URL on its own"),
        ("repo", "https://example.com/x.git", "a task file fetches no URL on its own"),
        ("repo", "git@example.com:x/y.git", "a task file fetches no URL on its own"),
    ],
    ids=["repo-abs", "repo-dotdot", "repo-link", "image-abs", "image-file-url", "image-http", "repo-https", "repo-ssh"],
)
def test_a_task_file_names_no_host_path_nor_url_on_its_own(tmp_path, monkeypatch, field, value, why):
    """Only what lies inside the task file's own directory (links resolved), or what the user allows
    with STROP_TASK_SOURCES; never a URL the user did not allow."""
    monkeypatch.delenv("STROP_TASK_SOURCES", raising=False)
    (tmp_path / "escape").symlink_to("/etc")
    suite = write(tmp_path / "t.jsonl", record(1, **{field: value}))
    with pytest.raises(UserError, match=re.escape(why)) as e:
        load_suite(suite)
    assert "\n" not in str(e.value) and f"field {field!r}" in str(e.value)


def test_the_user_allows_more_by_name(tmp_path, monkeypatch):
    import fsspec

    outside = tmp_path / "outside"
    (outside / "repo").mkdir(parents=True)
    (outside / "repo" / "m.py").write_text(ADD["m.py"])
    (tmp_path / "tasks").mkdir()
    with fsspec.open("memory://strop-allowed/img.tar", "wb") as f:
        f.write(b"")
    suite = write(
        tmp_path / "tasks" / "t.jsonl",
        record(1, repo="../outside/repo", image="memory://strop-allowed/img.tar", files={}),
    )
    monkeypatch.setenv("STROP_TASK_SOURCES", f"{outside} memory://strop-allowed/")
    (task,) = load_suite(suite, "eval")
    assert task.repo == str(outside / "repo") and task.image == "memory://strop-allowed/img.tar"


@pytest.mark.parametrize("key", ["../x.py", "/etc/x.py", "a/../../b.py", "", ".", "a//b.py", "a/./b.py", "x\0.py"])
@pytest.mark.parametrize("field", ["files", "hidden_tests"])
def test_hostile_key_paths_are_refused_up_front(tmp_path, field, key):
    rec = record(1)
    rec[field] = {**rec[field], key: "x = 1\n"}
    with pytest.raises(UserError, match=f"t.jsonl:1: field '{field}': .* is not a plain relative path"):
        load_suite(write(tmp_path / "t.jsonl", rec))


@pytest.mark.parametrize(
    "field, value",
    [
        ("timeout_s", -1),
        ("timeout_s", 0),
        ("timeout_s", 1e9),
        ("timeout_s", float("nan")),
        ("timeout_s", "10"),
        ("memory_mb", 0),
        ("memory_mb", 10**12),
        ("cpu_s", 1.5),
    ],
)
@pytest.mark.parametrize("where", ["top", "metadata"])
def test_bad_limits_are_refused_up_front_with_a_ceiling(tmp_path, field, value, where):
    rec = record(1, **({field: value} if where == "top" else {"metadata": {field: value}}))
    with pytest.raises(UserError, match=f"t.jsonl:1: field '{field}' must be a positive number"):
        load_suite(write(tmp_path / "t.jsonl", rec))


def test_a_test_id_is_never_an_option_of_the_runner(tmp_path):
    with pytest.raises(UserError, match="field 'FAIL_TO_PASS': '--junitxml=/tmp/x' starts with '-'"):
        load_suite(write(tmp_path / "t.jsonl", record(1, FAIL_TO_PASS=["--junitxml=/tmp/x"])))
