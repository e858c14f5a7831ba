"""An RL step's time budget (`strop.rl.budget`): the engine's counters on a real engine, and the
step rows' sums, idle time and critical path on known numbers."""

from strop.engine.engine import Engine
from strop.policy_api import SamplingParams
from strop.rl.budget import ROWS, budget_lines, budget_table, engine_budget, episode_budget
from strop.run_files import METRICS


def test_engine_counts_prefill_and_decode(tiny_model, tiny_tokenizer):
    eng = Engine(tiny_model, tiny_tokenizer, max_batch=4, max_len=256)
    prompts = [tiny_tokenizer.encode("def add(a, b):\n"), tiny_tokenizer.encode("class Point:\n    pass\n")]
    outs = eng.generate(prompts, SamplingParams(max_tokens=5, temperature=0, stop_token_ids=[]))
    s = eng.stats()
    assert s["prefilled_tokens"] == sum(len(p) for p in prompts)
    # every sampled token but each request's last is fed back as a decode row
    assert s["decoded_tokens"] == sum(len(o.token_ids) - 1 for o in outs) == 8
    assert s["prefill_s"] > 0 and s["decode_s"] > 0 and s["queued_s"] >= 0


def test_episode_and_engine_sums():
    timings = [
        {"total_s": 10.0, "policy_s": 6.0, "tools_s": 3.0, "sandbox_s": 0.5, "check_s": 2.0, "monitor_s": 0.1},
        {"total_s": 4.0, "policy_s": 2.0, "tools_s": 1.0, "sandbox_s": 0.5, "check_s": 1.0},
    ]
    e = episode_budget(timings)
    assert e["time_episodes"] == 2 and e["time_episode_policy_s"] == 8.0
    assert e["time_episode_harness_s"] == 2.0  # what the totals leave after policy and tools
    assert e["time_episode_monitor_s"] == 0.1 and e["time_episode_check_s"] == 3.0
    before = {"busy_s": 1.0, "prefill_s": 0.5, "decode_s": 0.2, "swap_s": 0.0, "decoded_tokens": 10, "engines": 2}
    after = {"busy_s": 7.0, "prefill_s": 2.5, "decode_s": 2.2, "swap_s": 0.3, "decoded_tokens": 110, "engines": 2}
    g = engine_budget(before, after, wall_s=5.0)
    assert g["time_engine_prefill_s"] == 2.0 and g["time_engine_decode_s"] == 2.0
    assert abs(g["time_engine_other_s"] - 1.7) < 1e-9  # busy 6.0 less prefill, decode and swaps
    assert g["time_engine_idle_s"] == 4.0  # two engines x 5 s, 6 s of it busy
    assert g["time_engine_decoded_tokens"] == 100


def test_table_names_every_part_and_the_critical_path():
    assert all(key in METRICS["rl"] for _, key in ROWS)  # every row is described in the metrics reference
    rows = [{"time_step_s": 10.0, "time_wait_s": 7.0, "time_train_s": 3.0, "forward_s": 1.0, "time_episodes": 32}] * 3
    b = budget_table(rows)
    assert b["steps"] == 3 and b["critical_path"] == "generation"
    assert next(r for r in b["rows"] if r["part"] == "forward_s")["s_per_step"] == 1.0
    assert "generation" in budget_lines(b)[-2]
    slow_trainer = [{**r, "time_wait_s": 0.5, "time_train_s": 9.5} for r in rows]
    assert budget_table(slow_trainer)["critical_path"] == "trainer"
    assert budget_table([{"step": 1}]) == {} and budget_lines({}) == []
