"""Regression guard for the demo's result (slow: the whole `strop demo`, about 20 minutes on 2
cores, so it is the README's claim checked end to end): RL lifts the SFT warm start's held-out solve
rate by at least 20 points, greedy and sampled at T = 1, each over 200 episodes, with the two 95%
intervals apart; and the summary names the CPU and the numerics it ran with.

Measured on a fresh clone with the numerics pinned (docs/results/demo.md, 2026-12-07): +22.0 greedy
and +27.5 sampled, intervals apart. Before the pin the gain moved with the CPU's warm start (+41.0
greedy from an 11.5% start on an AMD EPYC, +16.5 from 39.5% on an AVX2 VM); the margin is what
issue 54 accepts.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
GAIN = 0.20
EPISODES = 200


def test_the_demo_lifts_held_out_solve_rates_by_20_points_with_intervals_apart(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "strop.cli", "demo", "--config", str(REPO / "examples/demo.toml")]
        + ["--set", f"run.out_dir={tmp_path}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=3 * 3600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["cpu"]["model"] and summary["cpu"]["numerics"] in ("avx2", "native")
    sft, rl = summary["sft"], summary["rl"]
    for name, rate, ci in (("greedy", "solve_rate", "solve_rate_ci95"), ("sampled", "pass@1", "pass@1_ci95")):
        before, after = (s["sampled"] if name == "sampled" else s for s in (sft, rl))
        assert sft["eval_episodes"] == rl["eval_episodes"] == EPISODES
        assert after[rate] - before[rate] >= GAIN, (name, before[rate], after[rate])
        assert after[ci][0] > before[ci][1], (name, before[ci], after[ci])
