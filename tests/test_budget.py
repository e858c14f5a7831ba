"""An RL step's time budget (`strop.rl.budget`): the engine's counters on a real engine, CPU
readings of real processes, and the step rows' sums, idle time and critical path on known numbers."""

import subprocess
import sys
import time

from strop.engine.engine import Engine
from strop.policy_api import SamplingParams
from strop.rl.budget import ROWS, budget_lines, budget_table, cpu_budget, engine_budget, episode_budget
from strop.run_files import METRICS
from strop.runtime.cpus import cpu_reading, process_cpu_s

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"


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


def test_cpu_readings_count_a_live_process_and_the_machine():
    live = subprocess.Popen([sys.executable, "-c", BURN + "time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while process_cpu_s(live.pid) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        before = cpu_reading(live.pid)
        assert before["trainer"] >= 0.25
        # a process in a sandbox is seen only in the machine's figure: it burns outside this one
        subprocess.run([sys.executable, "-c", BURN], check=True)
        after = cpu_reading(live.pid)
        assert after["busy"] - before["busy"] >= 0.25
        assert after["loop"] >= before["loop"] and after["unused"] >= before["unused"]
    finally:
        live.kill()
        live.wait()
    assert process_cpu_s(live.pid) == 0.0  # gone: nothing to read


def test_cpu_budget_and_its_rows():
    before = {"trainer": 10.0, "loop": 5.0, "busy": 40.0, "unused": 100.0}
    after = {"trainer": 13.0, "loop": 7.0, "busy": 48.0, "unused": 102.0}
    c = cpu_budget(before, after)
    assert (c["time_cpu_trainer_s"], c["time_cpu_loop_s"], c["time_cpu_other_s"]) == (3.0, 2.0, 3.0)
    assert c["time_cpu_unused_s"] == 2.0
    assert cpu_budget({}, {}) == {}  # a runtime that cannot tell (Ray)
    b = budget_table([{"time_step_s": 5.0, "time_wait_s": 1.0, "time_train_s": 4.0, **c}])
    assert b["cpu_s_per_step"] == 10.0  # the machine's CPU seconds over the step, every row's
    line = next(x for x in budget_lines(b) if "time_cpu_other_s" in x)
    assert "| 30% |" in line  # of the machine's 10 CPU seconds, not of the step's 5 s
    plain = budget_table([{"time_step_s": 5.0, "time_wait_s": 1.0, "time_train_s": 4.0}])
    assert not any(r["side"] == "cpu" for r in plain["rows"])
