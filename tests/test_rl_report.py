"""The RL run report from a metrics file and two held-out evaluations: the table with outcomes,
the gain line, the behaviour table, and one PNG per plot."""

import json


def _eval(rate: float, outcomes: dict, sampled: float | None = None) -> dict:
    ev = {
        "solve_rate": rate,
        "solve_rate_ci95": [rate / 2, min(1.0, rate * 2)],
        "eval_episodes": 20,
        "by_difficulty": {"1": {"solve_rate": rate, "solve_rate_ci95": [0.0, 1.0], "eval_episodes": 20}},
        "outcomes": outcomes,
        "behaviour": {
            "episodes": 20,
            "turns": 4.0,
            "rejected_edit": rate,
            "retry_after_rejected_edit": 1 - rate,
            "test_runs": rate,
            "submitted_untested": 0.5,
            "submitted_failing_tests": 0.0,
        },
    }
    if sampled is not None:
        ci = [sampled / 2, min(1.0, sampled * 2)]
        by_d = {"1": {"pass@1": sampled, "pass@1_ci95": ci, "pass@k": sampled, "pass@k_ci95": ci, "tasks": 20}}
        ev["sampled"] = {"temperature": 1.0, "samples": 1, "pass@1": sampled, "pass@1_ci95": ci, "tasks": 20}
        ev["sampled"]["by_difficulty"] = by_d
    return ev


def test_report_has_evaluations_gain_and_plots(tmp_path):
    from strop.rl.report import write_report

    rows = [
        {
            "step": s,
            "mode": "async",
            "reward": 0.1 * s,
            "solve_rate": 0.1 * s,
            "staleness_hist": {"0": 4, "1": s},
            "bytes_synced": 1e6 * s,
            "k3": 0.001,
            "mismatch_mean_abs_dlogp": 0.01,
            "mismatch_ratio_outside_frac": 0.0,
            "trainer_busy": 0.9,
            "engine_busy": 0.6,
            "wall_s": 2.0 * s,
            "dropped_stale": 0,
            "hacked_total": 1,
            "hack_kinds": {"degenerate": 1} if s == 3 else {},
            "mixed_groups": 0.5,
            "dlogp_pos": 0.01,
            "dlogp_neg": -0.01,
            "clip_frac": 0.0,
            "behaviour_retry_after_rejected_edit": 0.1 * s,
            "behaviour_rejected_edit": 0.5,
        }
        for s in (1, 2, 3)
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = {
        "sft": _eval(0.25, {"no changes": 15, "solved": 5}, sampled=0.1),
        "rl": _eval(0.5, {"solved": 10, "tests failed": 10}, sampled=0.6),
    }
    text = write_report(tmp_path, metrics, evals).read_text()
    assert (
        "| sft, greedy | 0.250 |" in text and "no changes 15, solved 5" in text and "solved 10, tests failed 10" in text
    )
    assert "| sft, T = 1 | 0.100 |" in text and "| rl, T = 1 | 0.600 |" in text
    assert "**+25.0 points** greedy and by **+50.0 points** sampled" in text
    assert "3 steps (async)" in text and "bytes synced 3.0 MB" in text
    assert "flagged: 1 (flags by kind: degenerate 1)" in text
    assert "| retried after it | 0.75 | 0.50 |" in text
    for png in (
        "reward.png",
        "behaviour.png",
        "learning.png",
        "staleness.png",
        "bytes_synced.png",
        "mismatch.png",
        "busy.png",
    ):
        assert (tmp_path / png).stat().st_size > 0 and f"]({png})" in text


def test_gains_greedy_and_sampled_per_difficulty():
    from strop.rl.report import solve_rate_gains

    gains = solve_rate_gains({"sft": _eval(0.25, {}, sampled=0.1), "rl": _eval(0.5, {}, sampled=0.6)})
    assert gains == {"all": 0.25, "d1": 0.25, "sampled": 0.5, "sampled_d1": 0.5}
    assert solve_rate_gains({"sft": _eval(0.25, {}), "rl": _eval(0.5, {})}) == {"all": 0.25, "d1": 0.25}
