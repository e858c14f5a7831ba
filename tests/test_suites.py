"""Task suites: synthetic generation is deterministic and honest, humaneval is complete, mutated
builds verified mutants; a few tasks go through the real checker (sandboxed)."""

import ast
import dataclasses
import json

import pytest

from strop.env.grading.checker import check
from strop.env.suites import synthetic
from strop.env.suites.synthetic_lib import FAMILIES, LIBRARY
from strop.env.tasks.suites import get_task, list_suites, load_suite
from strop.env.world.patches import apply_edits, gold_changes, reference_edit
from strop.errors import UserError


def test_library_bugs_apply_exactly_once():
    for fn in LIBRARY:
        for family, bugs in fn.bugs.items():
            assert family in FAMILIES
            for old, new in bugs:
                assert fn.src.count(old) == 1 and old != new, (fn.name, old)


def test_synthetic_is_deterministic_small_and_split():
    a, b = synthetic.make_task(2, "eval", 7), synthetic.make_task(2, "eval", 7)
    assert a.to_dict() == b.to_dict()
    tasks = load_suite("synthetic", difficulty=1, limit=5)
    assert {t.split for t in tasks} == {"train", "eval"} and len(tasks) == 10
    evals = {json.dumps(t.files, sort_keys=True) for t in synthetic.load("eval", difficulty=1)}
    assert not any(
        json.dumps(t.files, sort_keys=True) in evals for t in synthetic.load("train", difficulty=1, limit=300)
    )
    for t in tasks + [synthetic.make_task(d, s, i) for d in (2, 3) for s in ("train", "eval") for i in range(3)]:
        source_lines = sum(v.count("\n") for k, v in t.files.items() if not k.startswith("tests/"))
        assert 15 <= source_lines <= 130, (t.id, source_lines)
        assert t.metadata["difficulty"] in (1, 2, 3) and t.metadata["family"] in FAMILIES
        for text in list(t.files.values()) + list(t.hidden_tests.values()):
            ast.parse(text)


def test_synthetic_families_all_occur():
    families = {synthetic.make_task(1, "train", i).metadata["family"] for i in range(60)}
    assert families == set(FAMILIES)


def test_reference_edit_is_unique_and_inverts():
    buggy = "a = 1\nb = 2\na = 1\n"
    old, new = reference_edit(buggy, "a = 1\nb = 3\na = 1\n")
    assert buggy.count(old) == 1 and buggy.replace(old, new) == "a = 1\nb = 3\na = 1\n"
    old, new = reference_edit(buggy, "a = 1\nb = 2\n")  # a deletion widens to unique context
    assert buggy.replace(old, new) == "a = 1\nb = 2\n"


def test_get_task_and_unknown_names():
    assert get_task("synthetic", "synthetic-d3-eval-0002").id == "synthetic-d3-eval-0002"
    assert set(list_suites()) >= {"synthetic", "humaneval", "mutated", "chain"}  # and installed packages' suites
    with pytest.raises(UserError):
        load_suite("nope")
    with pytest.raises(UserError):
        get_task("synthetic", "synthetic-d9-eval-0000")
    for malformed in ("synthetic-zzz-d1-eval-0001", "synthetic-d1-eval-0001-x"):  # not an id, not a bad theme name
        with pytest.raises(UserError, match="no task"):
            get_task("synthetic", malformed)


def test_synthetic_variant_narrows_the_bugs_to_its_themes():
    tasks = load_suite("synthetic/parse", "train", difficulty=2, limit=30)
    parse = {f.name for f in LIBRARY if f.theme == "parse"}
    assert {t.metadata["function"] for t in tasks} <= parse and len({t.metadata["function"] for t in tasks}) >= 5
    assert all(t.id.startswith("synthetic-parse-d2-train-") and t.suite == "synthetic" for t in tasks)
    assert get_task("synthetic", tasks[3].id).to_dict() == tasks[3].to_dict()  # the id is enough to rebuild it
    evals = {json.dumps(t.files, sort_keys=True) for t in load_suite("synthetic/parse", "eval", difficulty=2)}
    assert not any(json.dumps(t.files, sort_keys=True) in evals for t in tasks)
    assert load_suite("synthetic/seq+parse", "eval", difficulty=1, limit=1)[0].id == "synthetic-parse+seq-d1-eval-0000"
    for bad in ("synthetic/poetry", "humaneval/parse"):
        with pytest.raises(UserError):
            load_suite(bad, "eval", limit=1)


def test_humaneval_has_all_problems_with_stub_and_reference():
    tasks = load_suite("humaneval")
    assert len(tasks) == 164 and len({t.id for t in tasks}) == 164
    assert sum(t.split == "eval" for t in tasks) == 100
    for t in tasks:
        assert "raise NotImplementedError" in t.files["solution.py"]
        ast.parse(apply_edits(t.files, t.metadata["reference_edits"])["solution.py"])


def test_synthetic_references_pass_and_bugs_fail_through_checker():
    for d in (1, 2, 3):
        t = synthetic.make_task(d, "eval", 11)
        buggy = check(t, {})
        fixed = check(t, apply_edits(t.files, t.metadata["reference_edits"]))
        assert buggy.reward == 0 and buggy.failed > 0 and buggy.perturbed_reward is None, buggy  # unpaid: not rerun
        assert fixed.reward == 1 and fixed.perturbed_reward == 1, fixed
        # the perturbed tests catch the bug too, run as the hidden tests
        as_hidden = dataclasses.replace(
            t, hidden_tests=t.perturbed_tests, metadata={**t.metadata, "n_tests": t.metadata["n_perturbed_tests"]}
        )
        perturbed = check(as_hidden, {}, perturbed=False)
        assert perturbed.reward == 0 and perturbed.failed > 0, perturbed


def test_humaneval_subset_canonical_pass_stubs_fail():
    for t in load_suite("humaneval")[::17]:  # 10 problems
        assert check(t, apply_edits(t.files, t.metadata["reference_edits"]), perturbed=False).reward == 1, t.id
        assert check(t, {}, perturbed=False).reward == 0, t.id


@pytest.mark.slow
def test_humaneval_all_canonical_pass_all_stubs_fail():
    tasks = load_suite("humaneval")
    passed = [t.id for t in tasks if check(t, apply_edits(t.files, t.metadata["reference_edits"])).reward == 1]
    stubs = [t.id for t in tasks if check(t, {}, perturbed=False).reward > 0]
    assert len(passed) == 164 and stubs == []


@pytest.mark.slow  # toolz's whole suite, traced, then its candidates: a minute or two (test_synth.py: the fast one)
def test_mutated_builds_from_an_installed_package_and_loads(tmp_path):
    from strop.env.suites import mutated

    task_file = mutated.build("toolz", target=2, progress=False, cache=tmp_path)
    assert task_file == tmp_path / "toolz.jsonl"
    tasks = mutated.load(variant="toolz", cache=tmp_path)
    assert len(tasks) >= 2 and {t.suite for t in tasks} == {"mutated"}
    assert [t.id for t in mutated.load(cache=tmp_path)] == [t.id for t in tasks]  # every package built
    for t in tasks[:2]:
        assert t.metadata["source"] == "synthesized" and t.start_patch and "toolz/" in t.metadata["path"]
        fixed = check(t, gold_changes(t), perturbed=False)
        assert fixed.reward == 1 and fixed.passed == len(t.fail_to_pass + t.pass_to_pass), fixed
    with pytest.raises(UserError, match="not built"):
        mutated.load(variant="mpmath", cache=tmp_path)
    with pytest.raises(UserError, match="no installed package"):
        mutated.build("no_such_package", target=1, progress=False, cache=tmp_path)


def test_tasks_cli_export_then_check_round_trip(tmp_path, capsys):
    from strop.cli import main

    ws = tmp_path / "ws"
    assert main(["tasks", "export", "--suite", "synthetic", "synthetic-d1-eval-0001", str(ws)]) == 0
    task = get_task("synthetic", "synthetic-d1-eval-0001")
    assert {p.relative_to(ws).as_posix() for p in ws.rglob("*") if p.is_file()} == set(task.files)
    for path, text in apply_edits(task.files, task.metadata["reference_edits"]).items():
        (ws / path).write_text(text)
    (ws / "conftest.py").write_text("def pytest_configure(config):\n    pass\n")
    assert (
        main(
            [
                "tasks",
                "check",
                "--suite",
                "synthetic",
                "synthetic-d1-eval-0001",
                str(ws),
                "--json",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["reward"] == 1 and result["dropped_paths"] == ["conftest.py"]
    assert [f["kind"] for f in result["flags"]] == ["conftest_or_plugin"]
    assert main(["tasks", "export", "--suite", "synthetic", "synthetic-d1-eval-9999", str(tmp_path / "x")]) == 2


def test_tasks_check_grades_no_host_file_through_a_symlink(tmp_path, capsys):
    """Issue 45, item 5: a workspace whose fixed file is a symlink to a root-only host file holding
    the fix is not graded on that file's content (it used to earn reward 1)."""
    from strop.cli import main

    task = get_task("synthetic", "synthetic-d1-eval-0001")
    ws = tmp_path / "ws"
    assert main(["tasks", "export", "--suite", "synthetic", task.id, str(ws)]) == 0
    fixed = apply_edits(task.files, task.metadata["reference_edits"])
    secret = tmp_path / "host-secret.py"
    path = next(iter(fixed))
    secret.write_text(fixed[path])
    secret.chmod(0o600)
    (ws / path).unlink()
    (ws / path).symlink_to(secret)
    assert main(["tasks", "check", "--suite", "synthetic", task.id, str(ws), "--json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["reward"] == 0
    assert f"left out (not regular files): {path}" in capsys.readouterr().out
