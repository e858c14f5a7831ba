"""The real thing, small: tasks synthesized from a real project nobody here wrote (more-itertools, a
git bundle in ../shared/repos) in a Debian image built from Debian's packages, validated through
`strop tasks validate`, deterministic whatever the number of jobs; a setup the image cannot run is
one line. Slow: the traced baseline runs the project's whole suite (minutes on a loaded machine),
and the image is built unless STROP_DEBIAN_IMAGE names one."""

import json
from pathlib import Path

import pytest

from tests.test_mine_real import BUNDLE, debian_image, strop  # noqa: F401 (a fixture)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not BUNDLE.is_file(), reason=f"{BUNDLE} is not here (a clone of strop has no ../shared)"),
]
FAMILIES = "comparison,off_by_one,remove_return,wrong_variable"


def test_synthesized_more_itertools_tasks_validate_and_repeat(debian_image, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("STROP_TASK_SOURCES", f"{BUNDLE.parent} {debian_image}")  # outside the task file's folder
    out = tmp_path / "synth.jsonl"
    args = ["tasks", "synth", "--repo", str(BUNDLE), "--image", debian_image, "--rev", "v11.1.0"]
    args += [
        "--families",
        FAMILIES,
        "--max-tasks",
        "4",
        "--combined",
        "1",
        "--combine-in",
        "module",
        "--per-function",
        "2",
    ]
    run = strop(*args, "--out", str(out), "--jobs", "2", cwd=tmp_path)
    report = json.loads((tmp_path / "synth.report.json").read_text())
    assert report["kept"] == 5 and report["families"].get("combined") == 1, run.stdout
    assert set(report["families"]) <= {*FAMILIES.split(","), "combined"}
    assert report["tests"]["passing"] > 500 and report["recipe"] == {}  # flat layout: nothing to add
    tasks = [json.loads(line) for line in out.read_text().splitlines()]
    assert {Path(t["image"]).name for t in tasks} == {Path(debian_image).name}
    assert all(t["FAIL_TO_PASS"] and t["start_patch"] and t["patch"] for t in tasks)
    strop("tasks", "validate", str(out), "--jobs", "2", cwd=tmp_path)
    # the same repository, commit, image and options: the same bytes with one job
    again = tmp_path / "again.jsonl"
    strop(*args, "--out", str(again), "--jobs", "1", cwd=tmp_path)
    assert again.read_bytes() == out.read_bytes()
