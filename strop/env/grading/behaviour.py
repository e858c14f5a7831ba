"""What an agent did in an episode, as numbers: the behaviour statistics that show what training
changed (does it read the error after a rejected edit and try again, does it run the tests, does it
submit with failing tests), beside the solve rate that shows whether it mattered.

`episode_stats` reads one episode's tool-call log (plain dicts: name, role, arguments, output, error;
see `strop.env.episode.Episode`); `summarize` turns many into rates. Plain data in and out. Calls
are told apart by their declared role (`strop.env.harness.tools.ROLES`), never by tool name: an edit is a
call of an "edit" tool, a visible-test run a call of a "run" tool whose arguments mention pytest.
"""

from collections import Counter

# `summarize` keys as tables and plots name them, in the order they show them; the `retry_*` rates
# are conditional on the row before them
LABELS = {
    "turns": "turns per episode",
    "edits_applied": "edits applied",
    "edits_rejected": "edits rejected",
    "rejected_edit": "episodes with a rejected edit",
    "retry_after_rejected_edit": "retried after it",
    "test_runs": "visible-test runs",
    "failing_tests": "episodes with failing tests",
    "retry_after_failing_tests": "edited again after them",
    "submitted": "submitted",
    "submitted_untested": "submitted without testing",
    "submitted_failing_tests": "submitted with failing tests",
}


def _is_edit(call: dict) -> bool:
    return call.get("role") == "edit"


def _is_test_run(call: dict) -> bool:
    args = call.get("arguments")
    return (
        call.get("role") == "run"
        and isinstance(args, dict)
        and any(isinstance(v, str) and "pytest" in v for v in args.values())
    )


def _tests_failed(call: dict) -> bool:
    """A visible-test run that did not pass: rejected (timeout) or a non-zero exit code."""
    return call.get("error") is not None or not str(call.get("output", "")).startswith("exit code 0")


def episode_stats(tool_calls: list[dict], stop_reason: str, turns: int) -> dict:
    """One episode's behaviour: turns, calls by tool name, edits applied and rejected, visible-test
    runs, and 0/1 flags — rejected_edit (some edit was rejected), retried_after_rejected_edit (an
    edit attempt followed a rejected one), failing_tests / retried_after_failing_tests (the same for
    a failing visible-test run), submitted, submitted_untested (submitted without running the visible
    tests after its last edit), submitted_failing_tests (the last test run before submitting failed)."""
    names = Counter(c.get("name") or "invalid" for c in tool_calls)
    edit_at = [i for i, c in enumerate(tool_calls) if _is_edit(c)]
    edits = [tool_calls[i] for i in edit_at]
    last_edit = edit_at[-1] if edit_at else None
    rejected_edit = retried_edit = failing = retried_tests = 0
    last_test = None
    for i, c in enumerate(tool_calls):
        later_edit = last_edit is not None and i < last_edit
        if _is_edit(c):
            if c.get("error") is not None:
                rejected_edit = 1
                retried_edit |= later_edit
        elif _is_test_run(c):
            last_test = i
            if _tests_failed(c):
                failing = 1
                retried_tests |= later_edit
    submitted = stop_reason == "submitted"
    tested_after_edit = last_test is not None and (last_edit is None or last_test > last_edit)
    return {
        "turns": turns,
        "calls": dict(names),
        "edits_applied": sum(c.get("error") is None for c in edits),
        "edits_rejected": sum(c.get("error") is not None for c in edits),
        "test_runs": sum(_is_test_run(c) for c in tool_calls),
        "rejected_edit": rejected_edit,
        "retried_after_rejected_edit": int(retried_edit),
        "failing_tests": failing,
        "retried_after_failing_tests": int(retried_tests),
        "submitted": int(submitted),
        "submitted_untested": int(submitted and not tested_after_edit),
        "submitted_failing_tests": int(submitted and last_test is not None and _tests_failed(tool_calls[last_test])),
    }


def summarize(stats: list[dict]) -> dict:
    """Rates over episodes: means of the counts, calls per episode by tool, and the conditional
    rates that matter — `retry_after_rejected_edit` is P(another edit attempt | an edit was
    rejected), `retry_after_failing_tests` the same after a failing test run (None when the
    condition never happened)."""
    stats = [s for s in stats if s]  # trajectories made without a harness episode carry none
    n = len(stats)
    if not n:
        return {"episodes": 0}
    calls: Counter = Counter()
    for s in stats:
        calls.update(s["calls"])

    def mean(key: str) -> float:
        return round(sum(s[key] for s in stats) / n, 4)

    def given(key: str, condition: str) -> float | None:
        hit = [s for s in stats if s[condition]]
        return round(sum(s[key] for s in hit) / len(hit), 4) if hit else None

    return {
        "episodes": n,
        "turns": mean("turns"),
        "calls_per_episode": {k: round(v / n, 4) for k, v in calls.most_common()},
        "edits_applied": mean("edits_applied"),
        "edits_rejected": mean("edits_rejected"),
        "test_runs": mean("test_runs"),
        "rejected_edit": mean("rejected_edit"),
        "retry_after_rejected_edit": given("retried_after_rejected_edit", "rejected_edit"),
        "failing_tests": mean("failing_tests"),
        "retry_after_failing_tests": given("retried_after_failing_tests", "failing_tests"),
        "submitted": mean("submitted"),
        "submitted_untested": mean("submitted_untested"),
        "submitted_failing_tests": mean("submitted_failing_tests"),
    }
