"""`strop eval policy`: a saved (tiny, untrained) policy through the demo's held-out evaluation:
one line per difficulty, and JSON whose counts add up; how each episode ended for the checker."""

import dataclasses
import json


def test_eval_policy_reports_solve_rates_and_stops(tiny_tokenizer, tmp_path, capsys):
    from tests.conftest import tiny_model_section
    from strop.cli import main
    from strop.model.policy import build_model, save_model

    section = dataclasses.replace(tiny_model_section("qwen3_moe"), max_positions=2048)
    save_model(build_model(section, tiny_tokenizer, seed=0), tiny_tokenizer, tmp_path / "policy")
    argv = ["eval", "policy", "--policy", str(tmp_path / "policy"), "--json", str(tmp_path / "eval.json"),
            "--set", "rollout.eval_difficulties=[1, 2]", "--set", "rollout.eval_episodes=1",
            "--set", "rollout.max_turns=1", "--set", "rollout.max_context=1100", "--set", "rollout.workers=2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "solve_rate" in out and "stops" in out
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["eval_episodes"] == 2 and set(result["by_difficulty"]) == {"1", "2"}
    assert sum(result["stop_reasons"].values()) == 2 and 0.0 <= result["solve_rate"] <= 1.0
    assert result["outcomes"] == {"no changes": 2}  # one turn of an untrained policy edits nothing
    lo, hi = result["solve_rate_ci95"]
    assert 0.0 <= lo <= result["solve_rate"] <= hi <= 1.0


def test_outcome_names_how_an_episode_ended():
    from strop.rl.evaluate import outcome
    from strop.rl.trajectory import Trajectory

    def traj(reward: float, reason: str, flags: list | None = None) -> Trajectory:
        return Trajectory("t", "g", 0, [], reward, {"reason": reason}, flags or [])

    assert outcome(traj(1.0, "ok")) == "solved"
    assert outcome(traj(1.0, "ok", [{"kind": "test_edit", "evidence": ""}])) == "solved, hack-flagged"
    assert outcome(traj(0.0, "no changes")) == "no changes"
    assert outcome(traj(0.0, "3 of 27 tests did not pass")) == "tests failed"
    assert outcome(traj(0.0, "timeout after 30 s")) == "timeout after 30 s"
    assert outcome(traj(0.0, "checker error: OSError: gone")) == "checker error"
