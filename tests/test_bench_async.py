"""`strop bench async` end to end on its own small policy: interleaved sync/async pairs, the JSON
keys the issue names, and the median speedup over the pairs (slow: four short RL runs and two
evaluations)."""

import json
import statistics
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_async_reports_pooled_modes_and_median_pair(tmp_path):
    out = tmp_path / "result.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "strop.cli",
            "bench",
            "async",
            "--quick",
            "--steps",
            "2",
            "--repeats",
            "2",
            "--eval-episodes",
            "1",
            "--out",
            str(tmp_path / "work"),
            "--json",
            str(out),
        ],
        check=True,
        timeout=300,
    )
    result = json.loads(out.read_text())
    assert len(result["speedups"]) == 2 and result["repeats"] == 2
    assert result["speedup"] == pytest.approx(statistics.median(result["speedups"]), abs=1e-3)
    for mode in ("sync", "async"):
        figures = result[mode]
        assert figures["steps"] == 4  # two repeats of two steps, pooled
        assert figures["dropped"] == 0
        assert 0 < figures["trainer_busy"] <= 1 and 0 < figures["engine_busy"] <= 1
        assert figures["steps_per_hour"] == pytest.approx(4 * 3600 / figures["wall_s"], rel=0.05)  # wall_s is rounded
        assert figures["eval_episodes"] == 1 and 0 <= figures["solve_rate"] <= 1
