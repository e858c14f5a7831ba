"""Every suite trains and evaluates through one contract: `strop train` and `strop eval policy` on
humaneval (whose tasks take no difficulty) and on a task file of tasks at a commit of a real git
repository, run by a tiny policy through the real engine, sandboxes, checker and hack monitor."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.worldkit import calc_repo, git, sources_outside  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "rl.steps=2",
    "rl.group_size=2",
    "rl.batch_groups=1",
    "rl.measure_every=0",
    "rollout.workers=2",
    "rollout.engines=1",
    "rollout.max_turns=2",
    "rollout.max_context=512",
    "rollout.max_turn_tokens=32",
    "rollout.eval_episodes=2",
    "rollout.train_tasks=4",
    "run.threads=1",
]


def strop(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "STROP_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run([sys.executable, "-m", "strop.cli", *args], cwd=REPO, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def task_file(calc_repo, tmp_path_factory) -> str:
    repo, shas = calc_repo
    path = tmp_path_factory.mktemp("tasks") / "calc.jsonl"
    lines = []
    for i, (base, fix) in enumerate([("initial", "fix_add"), ("already_passing", "add_sub")]):
        lines.append(
            {
                "instance_id": f"calc-{i}",
                "problem_statement": git("log", "-1", "--format=%B", shas[fix], cwd=repo),
                "repo": str(repo),
                "base_commit": shas[base],
                "patch": git("diff", shas[base], shas[fix], "--", "calc.py", cwd=repo),
                "test_patch": git("diff", shas[base], shas[fix], "--", "tests", cwd=repo),
                "FAIL_TO_PASS": ["tests/test_calc.py::test_add" if i == 0 else "tests/test_calc.py::test_sub"],
            }
        )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return f"jsonl:{path}"


@pytest.mark.parametrize("suite", ["humaneval", "tasks"])
def test_train_and_eval_on_any_suite(suite, task_file, tiny_policy_dir, tmp_path):
    suite = task_file if suite == "tasks" else suite
    sets = [f"run.out_dir={tmp_path}", f"rollout.suite={suite}", *TINY]
    strop("train", "--policy", str(tiny_policy_dir), *[a for s in sets for a in ("--set", s)])
    rows = [json.loads(line) for line in (tmp_path / "run" / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    out = strop(
        "eval",
        "policy",
        "--policy",
        str(tmp_path / "run" / "rl" / "model"),
        "--json",
        str(tmp_path / "eval.json"),
        *[a for s in sets for a in ("--set", s)],
    ).stdout
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["eval_episodes"] == 2 and "solve_rate" in out
    lo, hi = result["solve_rate_ci95"]
    assert 0.0 <= lo <= result["solve_rate"] <= hi <= 1.0


def test_the_demonstrator_solves_a_task_at_a_commit_from_its_gold_patch(task_file, tiny_tokenizer):
    """SFT demonstrations for any task with a gold patch (a mined task's code part): the
    demonstrator plays its edits through the real harness, and the checker passes them."""
    from strop.env.demonstrators.runs import DEMONSTRATION_HARNESS, demonstration_episode
    from strop.env.grading.checker import check
    from strop.env.tasks.suites import load_suite

    for task in load_suite(task_file, "train"):
        episode, changes = demonstration_episode(task, tiny_tokenizer, replace(DEMONSTRATION_HARNESS, max_context=4096))
        assert episode.stop_reason == "submitted", episode.detail
        assert check(task, changes).reward == 1.0, task.id
