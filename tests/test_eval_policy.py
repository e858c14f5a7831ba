"""`strop eval policy`: a saved (tiny, untrained) policy through the demo's held-out evaluation:
one line per difficulty, and JSON whose counts add up; how each episode ended for the checker;
pass@1 and pass@K from K samples per task; behaviour statistics."""

import dataclasses
import json

import pytest


@pytest.fixture
def policy(tiny_tokenizer, tmp_path) -> str:
    """A saved tiny, untrained policy with room for the harness's windows."""
    from strop.model.policy import build_model, save_model
    from tests.conftest import tiny_model_section

    section = dataclasses.replace(tiny_model_section("qwen3_moe"), max_positions=2048)
    save_model(build_model(section, tiny_tokenizer, seed=0), tiny_tokenizer, tmp_path / "policy")
    return str(tmp_path / "policy")


def test_eval_policy_reports_solve_rates_and_stops(policy, tmp_path, capsys):
    from strop.cli import main

    argv = [
        "eval",
        "policy",
        "--policy",
        policy,
        "--json",
        str(tmp_path / "eval.json"),
        "--set",
        "rollout.eval_difficulties=[1, 2]",
        "--set",
        "rollout.eval_episodes=1",
        "--set",
        "rollout.max_turns=1",
        "--set",
        "rollout.max_context=1100",
        "--set",
        "rollout.workers=2",
        "--samples",
        "2",
        "--set",
        f"run.out_dir={tmp_path / 'runs'}",
        "--set",
        "run.name=e",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "solve_rate" in out and "stops" in out and "pass@2" in out and "retried after it" in out
    # the episodes are kept, as log.rollouts says: `strop runs show` reads them
    assert f"episodes kept in {tmp_path / 'runs' / 'e' / 'eval' / 'rollouts'}" in out
    assert main(["runs", "show", str(tmp_path / "runs" / "e"), "--stage", "eval", "--eval", "greedy"]) == 0
    assert capsys.readouterr().out.count("task ") >= 2
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["eval_episodes"] == 2 and set(result["by_difficulty"]) == {"1", "2"}
    assert sum(result["stop_reasons"].values()) == 2 and 0.0 <= result["solve_rate"] <= 1.0
    assert result["outcomes"] == {"no changes": 2}  # one turn of an untrained policy edits nothing
    assert result["reward_mean"] == 0.0 and result["reward_ci95"] == [0.0, 0.0]
    lo, hi = result["solve_rate_ci95"]
    assert 0.0 <= lo <= result["solve_rate"] <= hi <= 1.0
    assert result["behaviour"]["episodes"] == 2 and result["behaviour"]["turns"] == 1.0
    sampled = result["sampled"]
    assert sampled["samples"] == 2 and sampled["tasks"] == 2 and set(sampled["by_difficulty"]) == {"1", "2"}
    assert sampled["behaviour"]["episodes"] == 4
    assert 0.0 <= sampled["pass@1"] <= sampled["pass@k"] <= 1.0


def test_eval_policy_can_play_the_train_tasks_rl_draws(policy, tmp_path, capsys):
    """`--split train`: rollout.difficulties and rollout.train_tasks decide what is played, not the
    held-out settings (the check for a warm start that memorized its SFT tasks)."""
    from strop.cli import main

    sets = ["rollout.difficulties=[2]", "rollout.train_tasks=2", "rollout.train_start=5", "rollout.max_turns=1"]
    sets += ["rollout.eval_difficulties=[1]", "rollout.max_context=1100", "rollout.workers=2"]
    argv = ["eval", "policy", "--policy", policy, "--split", "train", "--samples", "0"]
    argv += ["--json", str(tmp_path / "train.json"), *(a for s in sets for a in ("--set", s))]
    assert main(argv) == 0
    result = json.loads((tmp_path / "train.json").read_text())
    assert result["eval_episodes"] == 2 and set(result["by_difficulty"]) == {"2"}


def test_pass_at_k_counts_tasks_not_samples():
    from strop.rl.evaluate import _pass_figures

    figures = _pass_figures([[True, False, False, False], [False] * 4, [True] * 4, [False, True, False, False]])
    assert figures["pass@1"] == round((0.25 + 0 + 1 + 0.25) / 4, 4) and figures["pass@k"] == 0.75
    lo, hi = figures["pass@1_ci95"]
    assert lo < figures["pass@1"] < hi


def test_outcome_names_how_an_episode_ended():
    from strop.rl.evaluate import outcome
    from strop.rl.trajectory import Trajectory

    def traj(reward: float, reason: str, flags: list | None = None, outcome: str = "not scored") -> Trajectory:
        return Trajectory("t", "g", 0, [], reward, {"reason": reason, "outcome": outcome}, flags or [])

    assert outcome(traj(1.0, "ok")) == "solved"
    assert outcome(traj(1.0, "ok", [{"kind": "test_edit", "evidence": ""}])) == "solved, hack-flagged"
    assert outcome(traj(1.0, "ok", [{"kind": "degenerate", "evidence": "3 of 5 calls invalid"}])) == "solved"
    assert outcome(traj(0.0, "no changes", outcome="no changes")) == "no changes"
    assert outcome(traj(0.0, "3 of 27 tests did not pass", outcome="tests failed")) == "tests failed"
    assert outcome(traj(0.0, "timeout after 30 s")) == "timeout after 30 s"
    assert outcome(traj(0.0, "checker error: OSError: gone")) == "checker error"


def test_more_engines_change_the_wall_time_only(policy, tmp_path):
    """Episodes dealt to two engines score exactly as on one: a row's numbers do not depend on its batch."""
    from strop.config import load_config
    from strop.rl.evaluate import evaluate

    base = ["rollout.eval_difficulties=[1]", "rollout.eval_episodes=4", "rollout.max_turns=2"]
    base += ["rollout.max_context=1100", "rollout.workers=4"]
    results = []
    for engines in (1, 2):
        cfg = load_config(None, [*base, f"rollout.engines={engines}"])
        result = evaluate(cfg, policy)
        result.pop("wall_s")
        results.append(result)
    assert results[0] == results[1]
    assert results[0]["behaviour"]["episodes"] == 4
