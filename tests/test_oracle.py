"""The scripted oracle solves synthetic tasks through the real harness, tools, sandbox and
checker, and its episodes are valid demonstration data."""

from dataclasses import replace

import pytest

from strop.env.demonstrators.imperfect import plan
from strop.env.demonstrators.runs import (
    DEMONSTRATION_HARNESS,
    demonstration_episode,
    demonstration_episodes_per_s,
    solve,
)
from strop.env.grading.checker import check
from strop.env.tasks.suites import load_suite


@pytest.fixture(scope="module")
def tasks():
    return load_suite("synthetic", "eval", limit=1)  # one task of each difficulty


def test_plan_locates_reads_edits_tests_and_submits(tasks):
    names = [[c["function"]["name"] for c in m["tool_calls"]][0] for m in plan(tasks[0])]
    assert names == ["read_file", "edit_file", "run", "submit"]  # difficulty 1 names the file
    first = [m["tool_calls"][0]["function"] for m in plan(tasks[1])][0]  # difficulty 2 names a failing test file
    assert first["name"] == "run" and "--tb=no tests/test_" in first["arguments"]["command"]
    assert [m["tool_calls"][0]["function"]["name"] for m in plan(tasks[2])][0] == "grep"  # 3 quotes a call


def test_oracle_solves_each_difficulty(tiny_tokenizer, tasks):
    # the test tokenizer has a 512-token vocabulary, so its windows run longer than the demo's
    config = replace(DEMONSTRATION_HARNESS, max_context=4096)
    for task in tasks:
        episode, changes = demonstration_episode(task, tiny_tokenizer, config)
        assert episode.stop_reason == "submitted", (task.id, episode.detail)
        assert all(c["error"] is None for c in episode.tool_calls), episode.tool_calls
        score = check(task, changes, perturbed=False)
        assert score.reward == 1.0, (task.id, score.reason)
        seg = episode.segments[0]
        assert len(episode.segments) == 1 and len(seg) <= 4096 and 0 < sum(seg.loss_mask) < len(seg)


def test_run_oracle_episodes_reports_a_rate(tiny_tokenizer):
    assert demonstration_episodes_per_s(1, tiny_tokenizer) > 0


@pytest.mark.slow
def test_oracle_solves_99_percent_of_synthetic_eval(tiny_tokenizer):
    tasks = load_suite("synthetic", "eval", limit=20)
    report = solve(
        tasks, tiny_tokenizer, replace(DEMONSTRATION_HARNESS, max_context=4096)
    )  # the test tokenizer's windows run long
    assert report["rate"] >= 0.99, [r for r in report["results"] if r["reward"] < 1.0]


def _parse_tasks(n: int = 12):
    return load_suite("synthetic/parse", "train", difficulty=1, limit=n)


def test_a_careless_demonstrator_gives_up_after_a_rejected_edit_and_a_careful_one_recovers(tiny_tokenizer):
    from random import Random

    from strop.env.demonstrators.imperfect import DemoStyle, misremembered

    task = next(t for t in _parse_tasks() if any(s["before"] for s in t.metadata["suspect_edits"]))
    suspect = {**next(s for s in task.metadata["suspect_edits"] if s["before"]), "kind": "suspect"}
    slip = misremembered(task, Random(0))
    assert slip is not None and slip["old"] not in task.files[slip["path"]]
    config = replace(DEMONSTRATION_HARNESS, max_context=4096)
    careless, changes = demonstration_episode(
        task, tiny_tokenizer, config, style=DemoStyle(careful=False, wrong=(suspect,))
    )
    assert [c["name"] for c in careless.tool_calls] == ["read_file", "edit_file", "submit"]
    assert careless.tool_calls[1]["error"] and not changes  # the bug is still there
    careful, changes = demonstration_episode(
        task, tiny_tokenizer, config, style=DemoStyle(careful=True, wrong=(suspect, slip))
    )
    errors = [c["error"] is not None for c in careful.tool_calls]
    assert [c["name"] for c in careful.tool_calls] == [
        "read_file",
        "edit_file",
        "edit_file",
        "edit_file",
        "run",
        "submit",
    ]
    assert errors == [False, True, True, False, False, False]
    assert "closest text" in careful.tool_calls[2]["output"]  # the misremembered line is shown as it is
    assert check(task, changes, perturbed=False).reward == 1.0


def test_demonstrator_mix_draws_the_configured_population(tiny_tokenizer):
    from strop.env.demonstrators.imperfect import DemonstratorMix

    tasks = _parse_tasks(12)
    report = solve(
        tasks,
        tiny_tokenizer,
        replace(DEMONSTRATION_HARNESS, max_context=4096),
        check=True,
        mix=DemonstratorMix(careful=0.5, suspects=0.7, misremember=0.3),
        workers=2,
    )
    styles = report["styles"]
    assert styles["off_plan"] == 0 and styles["wrong_first"] == styles["recovered"] + styles["gave_up"]
    assert 0 < styles["careful"] < len(tasks) and styles["recovered"] > 0 and styles["gave_up"] > 0
    for r in report[
        "results"
    ]:  # a careful demonstrator always solves; a careless one fails exactly when it guessed wrong
        assert r["reward"] == (1.0 if r["careful"] or not r["wrong"] else 0.0), r
