"""`strop bench envs --quick`: every number it promises, from real sandboxes, checkouts and mining."""

import json
import subprocess
import sys

from tests.worldkit import calc_repo, image_layers, test_image  # noqa: F401

KEYS = (
    "image_sandbox_start_ms_p50",
    "host_sandbox_start_ms_p50",
    "repo_materialise_ms_cold",
    "repo_materialise_ms_cached",
    "mine_tasks_kept",
    "mine_s_per_commit",
)


def test_bench_envs_quick_reports_its_keys(calc_repo, test_image, tmp_path):
    repo, _ = calc_repo
    out = tmp_path / "envs.json"
    run = subprocess.run(
        [sys.executable, "-m", "strop.cli", "bench", "envs", "--quick", "--runs", "5", "--commits", "2"]
        + ["--image", test_image, "--repo", str(repo), "--json", str(out)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(out.read_text())
    assert all(isinstance(res[k], (int, float)) and res[k] > 0 for k in KEYS), res
    assert res["mine_tasks_kept"] == 2 and res["mine_candidates"] == 3
    assert res["image_vs_host_start_p50"] == res["image_sandbox_start_ms_p50"] / res["host_sandbox_start_ms_p50"]
    assert "image / host start (p50)" in run.stdout
