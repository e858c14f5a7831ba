"""`strop bench scaleout` end to end on its local 3-node cluster: the JSON keys the issue names, one
delta per inference cluster and version, nothing lost or trained twice (slow: two short RL runs of
the demo-size policy on six Ray actors each)."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


def test_bench_scaleout_reports_egress_pauses_and_both_sync_types(tmp_path):
    out = tmp_path / "result.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "strop.cli",
            "bench",
            "scaleout",
            "--steps",
            "3",
            "--out",
            str(tmp_path / "work"),
            "--json",
            str(out),
        ],
        check=True,
        timeout=1200,
    )
    r = json.loads(out.read_text())
    assert r["egress_deltas_per_cluster_version"] == 1.0
    assert r["engines_joined"] == r["engines_lost"] == 2  # one of each per run
    assert r["trajectories_lost"] == 0 and r["trained_twice"] == 0
    assert r["swap_pause_ms_p50"] > 0 and r["steps_per_hour_delta"] > 0 and r["steps_per_hour_full"] > 0
    assert r["delta_vs_full_bytes_per_version"] < 0.5
    assert [v["egress_deltas"] for v in r["versions"]] == [2, 2, 2]
    assert all(v["time_to_all_engines_s"] is not None for v in r["versions"])
