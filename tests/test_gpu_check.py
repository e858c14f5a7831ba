"""The prepared GPU check (`scripts/gpu_check.sh`) in its CPU dry-run mode: the same steps (build a
small MoE in HF format, async RL through the configured engine, the summary) with strop's engine in
place of vLLM, so the script's code path is tested where no GPU is."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


@pytest.mark.slow
def test_the_gpu_check_runs_on_cpu_in_dry_run_mode(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "MIDTRAIN_STEPS": "2", "RL_STEPS": "1", "STROP_THREADS": "1"}
    done = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "[gpu_check] rl: 1 steps" in done.stdout and done.stdout.rstrip().endswith("[gpu_check] ok")
    assert (tmp_path / "out" / "summary.txt").read_text().startswith("rl steps: 1")


def test_without_a_gpu_the_real_check_refuses_in_one_line(tmp_path):
    env = {**os.environ, "PATH": "/usr/bin:/bin", "PYTHON": sys.executable}  # no nvidia-smi on this PATH
    if any((Path(d) / "nvidia-smi").exists() for d in ("/usr/bin", "/bin")):
        pytest.skip("this machine has nvidia-smi")
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "use --dry-run" in done.stderr
