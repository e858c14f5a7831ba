"""Long-horizon episodes with a model in the loop: SFT demonstrations made under the rollout's
context strategy hold its resets and summaries; a trajectory keeps what each reset carried (the
compaction-error probe, the summaries); `strop bench longctx --policy` plays a saved model under
every strategy and writes the figures the issue names."""

import json

from strop.config import load_config
from strop.env.demonstrators.chain import ChainDemonstrator
from strop.env.harness.context import SUMMARY_HEADER, SUMMARY_REQUEST, context_figures
from strop.env.harness.loop import Harness, harness_config
from strop.env.suites.chain import make_task
from strop.rl.rollout import WorkItem, rollout
from strop.train.sft_data import load_demonstrations

WINDOW = 2400  # as in test_chain: the test tokenizer spends about twice the default one's tokens per line
LONG = [
    "rollout.context_strategy=summarize",
    f"rollout.max_context={WINDOW}",
    "rollout.max_turn_tokens=256",
    "rollout.summary_tokens=200",
    "rollout.max_turns=40",
    "rollout.max_resets=20",
]


def test_demonstrations_hold_the_rollouts_resets_and_summaries(tiny_tokenizer, tmp_path):
    cfg = load_config(None, ["sft.suite=chain", "sft.episodes=2", "sft.difficulties=[2]", *LONG])
    episode = load_demonstrations(cfg, tiny_tokenizer, tmp_path / "demos.jsonl")[0]
    assert episode.stop_reason == "submitted" and len(episode.resets) >= 5
    assert len(episode.segments) == len(episode.resets) + 1
    assert all(len(s) <= WINDOW for s in episode.segments)
    # every window but the last closes with the demonstrator's summary, trained like any action
    for seg in episode.segments[:-1]:
        asked, summary = seg.messages[-2:]
        assert asked["content"] == SUMMARY_REQUEST and summary["role"] == "assistant"
        assert sum(seg.loss_mask) > 0
    for seg in episode.segments[1:]:
        assert seg.messages[2]["content"].startswith(SUMMARY_HEADER)
    # the default strategy keeps the model's whole window, as before
    assert load_config(None, ["sft.suite=chain"]).rollout.context_strategy == "none"


def test_a_trajectory_keeps_resets_summaries_and_the_facts_probe(tiny_tokenizer):
    cfg = load_config(None, LONG)
    task = make_task(2, "eval", 1)
    harness = Harness(tiny_tokenizer, harness_config(cfg.rollout))
    traj = rollout(task, ChainDemonstrator(task, harness.format), harness, WorkItem(task.id, "g", 0, 0, 0))
    ctx = traj.context
    assert traj.solved and ctx["resets"] == len(traj.segments) - 1 >= 5
    assert ctx["facts_found"] > 0 and ctx["facts_lost"] == 0
    assert len(ctx["summaries"]) == ctx["resets"] and task.metadata["facts"][0] in ctx["summaries"][-1]
    assert ctx["tokens"] == sum(len(s) for s in traj.segments)
    figures = context_figures([ctx, {**ctx, "resets": 0, "carried_tokens": [], "facts_lost": 1}])
    assert figures["resets_mean"] == ctx["resets"] / 2 and figures["resets_min"] == 0
    assert figures["compaction_error"] == 1 / (2 * ctx["facts_found"])


def test_bench_longctx_plays_a_saved_policy_under_every_strategy(tiny_policy_dir, tmp_path, capsys):
    from strop.cli import main

    out = tmp_path / "longctx.json"
    argv = ["bench", "longctx", "--policy", str(tiny_policy_dir), "--episodes", "1", "--difficulty", "1"]
    assert main([*argv, "--set", "rollout.engines=1", "--json", str(out)]) == 0
    assert "the model in" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["policy"] == str(tiny_policy_dir)
    assert set(r["strategies"]) == {"learned", "truncation", "masking", "compaction"}
    keys = {"solve_rate", "solve_rate_ci95", "eval_episodes", "carried_tokens_mean", "resets_mean", "compaction_error"}
    for figures in r["strategies"].values():
        assert keys <= set(figures) and figures["eval_episodes"] == 1
        assert figures["solve_rate"] <= figures["reward_mean"] <= 1.0
    assert set(r["facts"]) == set(r["strategies"]["learned"]["episodes"])
    episode = next(iter(r["strategies"]["learned"]["episodes"].values()))
    assert {"solved", "reward", "stop_reason", "summaries", "facts_shown"} <= set(episode)
    assert episode["reward"] == r["strategies"]["learned"]["reward_mean"]

    # the long-horizon report: this run against an earlier one, here the same policy on one strategy
    report = tmp_path / "report" / "longctx.md"
    report.parent.mkdir()  # an output file's folder is the user's to make (as for --json and sync -o)
    again = [*argv, "--set", "rollout.engines=1", "--strategies", "learned", "--before", str(out)]
    assert main([*again, "--report", str(report)]) == 0
    text = report.read_text()
    assert "| learned | solved [95% interval] |" in text and "| truncation | solved" in text
    assert "not run" in text and f"### {next(iter(r['facts']))}" in text


def test_bench_longctx_refuses_bad_arguments_in_one_line(tmp_path, capsys):
    from strop.cli import main

    base = ["bench", "longctx", "--episodes", "1"]
    for extra in (
        ["--strategies", "learned,summaries"],
        ["--report", str(tmp_path / "r.md")],  # no --policy, no --before
        ["--before", str(tmp_path / "b.json")],  # --before without --report
    ):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_the_report_strikes_wrong_keys_and_counts_what_each_summary_kept():
    from strop.bench.longctx_report import render

    facts = {"chain-d1-eval-0000": ["1111-2222", "3333-4444"]}

    def run(summaries, solved):
        episode = {"solved": solved, "stop_reason": "submitted", "summaries": summaries, "facts_shown": [1, 2]}
        figures = {
            "solve_rate": float(solved),
            "solve_rate_ci95": [0.0, 1.0],
            "eval_episodes": 1,
            "resets_mean": 2.0,
            "resets_min": 2,
            "carried_tokens_mean": 50.0,
            "compaction_error": 0.5,
            "facts_found": 4,
            "tokens_per_episode": 900.0,
            "episodes": {"chain-d1-eval-0000": episode},
        }
        return {"difficulty": 1, "window": 1024, "policy": "p", "facts": facts, "strategies": {"learned": figures}}

    before = run(["Keys: 1111-2222", "Keys: 1111-2222 3333-4445"], False)
    after = run(["Keys: 1111-2222", "Keys: 1111-2222 3333-4444"], True)
    text = render(before, after)
    assert "| 2 | 1/2 keys: Keys: 1111-2222 ~~3333-4445~~ | 2/2 keys: Keys: 1111-2222 3333-4444 |" in text
    assert "| learned | mean reward: share of checks passed [95% interval] | — | — |" in text  # older JSONs
    assert "Before RL: not solved (submitted); after RL: solved (submitted)." in text
    assert "1 solved only after RL, 0 only before (exact McNemar p = 1)." in text


def test_bench_longctx_scores_the_demonstrator_with_its_checker_reward(tmp_path, capsys):
    from strop.cli import main

    out = tmp_path / "demonstrator.json"
    argv = ["bench", "longctx", "--episodes", "2", "--difficulty", "1", "--window", "1536"]
    assert main([*argv, "--strategies", "learned,truncation", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["strategies"]
    # the demonstrator copies whatever its window holds: its own summaries carry every key
    assert r["learned"]["solve_rate"] == r["learned"]["reward_mean"] == 1.0
    assert 0.0 <= r["truncation"]["reward_mean"] <= 1.0 and "reward_mean" in capsys.readouterr().out
