"""Behaviour statistics read off an episode's tool-call log: what an agent did, as numbers."""

from strop.env.grading.behaviour import episode_stats, summarize
from strop.env.harness.tools import load_tools

CODING = load_tools()


def call(name: str, error: str | None = None, output: str = "", **arguments) -> dict:
    """A log entry as the harness writes it, the role from the built-in tool set."""
    return {"name": name, "role": CODING.role(name), "arguments": arguments, "output": output, "error": error}


def test_a_retry_after_a_rejected_edit_and_a_tested_submit():
    log = [
        call("read_file", path="a.py"),
        call("edit_file", error="old text not found", path="a.py", old="x", new="y"),
        call("edit_file", path="a.py", old="z", new="y"),
        call("run", output="exit code 0\n3 passed", command="pytest -q"),
        call("submit"),
    ]
    s = episode_stats(log, "submitted", 5)
    assert s["calls"] == {"read_file": 1, "edit_file": 2, "run": 1, "submit": 1}
    assert (s["edits_applied"], s["edits_rejected"], s["test_runs"]) == (1, 1, 1)
    assert s["rejected_edit"] == s["retried_after_rejected_edit"] == 1
    assert s["submitted"] == 1 and s["submitted_untested"] == 0 and s["submitted_failing_tests"] == 0


def test_giving_up_and_submitting_with_failing_tests():
    gave_up = episode_stats(
        [call("edit_file", error="old text not found", path="a.py", old="x", new="y"), call("submit")], "submitted", 2
    )
    assert (
        gave_up["rejected_edit"] == 1
        and gave_up["retried_after_rejected_edit"] == 0
        and gave_up["submitted_untested"] == 1
    )
    failing = episode_stats(
        [
            call("edit_file", path="a.py", old="x", new="y"),
            call("run", output="exit code 1\n1 failed", command="python -m pytest -q"),
            call("submit"),
        ],
        "submitted",
        3,
    )
    assert failing["failing_tests"] == 1 and failing["retried_after_failing_tests"] == 0
    assert failing["submitted_failing_tests"] == 1 and failing["submitted_untested"] == 0


def test_summary_rates_are_conditional_where_they_should_be():
    retried = episode_stats(
        [call("edit_file", error="no", path="a", old="x", new="y"), call("edit_file", path="a", old="z", new="y")],
        "max_turns",
        2,
    )
    quit_ = episode_stats([call("edit_file", error="no", path="a", old="x", new="y")], "no_tool_call", 2)
    clean = episode_stats([call("edit_file", path="a", old="z", new="y"), call("submit")], "submitted", 2)
    summary = summarize([retried, quit_, clean, {}])  # {}: a trajectory made without an episode
    assert summary["episodes"] == 3 and summary["rejected_edit"] == round(2 / 3, 4)
    assert summary["retry_after_rejected_edit"] == 0.5  # of the two episodes with a rejected edit
    assert summary["retry_after_failing_tests"] is None  # never happened
    assert summary["calls_per_episode"]["edit_file"] == round(4 / 3, 4)
