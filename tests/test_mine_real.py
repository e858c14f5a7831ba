"""The real thing, small: a Debian image built from Debian's packages, tasks mined from the history of
a real project nobody here wrote (more-itertools, a git bundle in ../shared/repos), validated, then
evaluated and trained on through the real sandbox, checker and hack monitor. Slow: it builds the
image (about a minute, from Debian's mirror) unless STROP_DEBIAN_IMAGE names one already built."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO.parent / "shared" / "repos" / "more-itertools.bundle"
pytestmark = pytest.mark.slow


def strop(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", "strop.cli", *args], capture_output=True, text=True, cwd=cwd)
    assert run.returncode == 0, f"strop {' '.join(args)}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run


@pytest.fixture(scope="module")
def debian_image(tmp_path_factory) -> str:
    if os.environ.get("STROP_DEBIAN_IMAGE"):
        return os.environ["STROP_DEBIAN_IMAGE"]
    if shutil.which("mmdebstrap") is None:
        pytest.skip("mmdebstrap is not installed (apt-get install mmdebstrap)")
    image = tmp_path_factory.mktemp("debian") / "img.tar"
    build = subprocess.run(
        ["mmdebstrap", "--variant=minbase", "--include=python3,python3-pytest,git,python-is-python3", "bookworm"]
        + [str(image)],
        capture_output=True,
        text=True,
        # reproducible: the same packages give the same tarball, so the node cache unpacks it once
        env={**os.environ, "SOURCE_DATE_EPOCH": "1700000000"},
    )
    if build.returncode != 0:  # no route to Debian's mirror, or no right to build a root here
        pytest.skip(f"mmdebstrap could not build the image: {(build.stderr.strip().splitlines() or ['?'])[-1]}")
    return str(image)


@pytest.mark.skipif(not BUNDLE.is_file(), reason=f"{BUNDLE} is not here (a clone of strop has no ../shared)")
def test_mined_more_itertools_tasks_validate_evaluate_and_train(debian_image, tmp_path, monkeypatch):
    # the bundle and the image lie outside the task file's folder: the user names them
    monkeypatch.setenv("STROP_TASK_SOURCES", f"{BUNDLE.parent} {debian_image}")
    version = strop("sandbox", "run", "--image", debian_image, "--", "python3", "--version", cwd=tmp_path)
    assert version.stdout.strip() == "Python 3.11.2", version.stdout  # bookworm's python3, not strop's
    out = tmp_path / "mined.jsonl"
    # the 20 commits before v7.2.0 (2019): six candidates, a minute or two
    mined = strop(
        *("tasks", "mine", "--repo", str(BUNDLE), "--image", debian_image, "--out", str(out)),
        *("--rev", "v7.2.0", "--max-commits", "20", "--tests", "touched", "--jobs", "2"),
        cwd=tmp_path,
    )
    report = json.loads((tmp_path / "mined.report.json").read_text())
    assert (report["commits_walked"], report["candidates"], report["kept"]) == (20, 6, 5), mined.stdout
    assert report["dropped"]["no failing test"] == 1 and (report["train"], report["eval"]) == (4, 1), report
    strop("tasks", "validate", str(out), "--jobs", "2", cwd=tmp_path)

    # the tiny pipeline on the mined tasks: a policy mid-trained in seconds, two RL steps, the held-out rate
    shutil.copytree(Path(json.__file__).parent, tmp_path / "corpus" / "json")
    tiny = str(REPO / "examples" / "tiny.toml")
    strop("midtrain", "--config", tiny, cwd=tmp_path)
    suite = f"rollout.suite=jsonl:{out}"
    strop(
        "train",
        "--config",
        tiny,
        "--policy",
        "runs/tiny/midtrain/model",
        "--set",
        suite,
        "--set",
        "rl.steps=2",
        cwd=tmp_path,
    )
    strop(
        *("eval", "policy", "--config", tiny, "--policy", "runs/tiny/rl/model", "--set", suite),
        *("--set", f"rollout.eval_episodes={report['eval']}", "--json", "eval.json"),
        cwd=tmp_path,
    )
    figures = json.loads((tmp_path / "eval.json").read_text())
    assert 0.0 <= figures["solve_rate"] <= 1.0 and len(figures["solve_rate_ci95"]) == 2, figures
