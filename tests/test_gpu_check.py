"""The prepared GPU check (`scripts/gpu_check.sh`) in its CPU dry-run mode: the same steps (mid-train
a small MoE in HF format, SFT, async RL through the configured engine, the JSON summary) with a tiny
MoE, the trainer on the CPU in bf16 autocast and strop's engine in place of vLLM, so the script's
code path is tested where no GPU is."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def test_the_gpu_check_runs_on_cpu_in_dry_run_mode(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "STROP_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "[gpu_check] rl: 1 steps" in done.stdout and done.stdout.rstrip().endswith("[gpu_check] ok")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["device"] == "cpu" and summary["peak_bf16_tflops"] is None and summary["active_params"] > 0
    assert summary["midtrain"]["precision"] == "bf16" and summary["midtrain"]["device"] == "cpu"
    for stage in ("midtrain", "sft"):
        assert summary[stage]["mfu"] is None and summary[stage]["peak_mem_mib"] > 0  # no GPU peak to divide by
    rl = summary["rl"]
    assert rl["steps"] == 1 and rl["trainer_tokens_per_s"] > 0 and rl["rollout_tokens_per_s"] > 0
    assert rl["publish_s"] > 0 and rl["weight_sync_s"]["versions"] == 1 and rl["peak_mem_mib"] > 0
    assert "routing" not in summary  # the vLLM bench runs on the GPU only


def test_without_a_gpu_the_real_check_refuses_in_one_line(tmp_path):
    env = {**os.environ, "PATH": "/usr/bin:/bin", "PYTHON": sys.executable}  # no nvidia-smi on this PATH
    if any((Path(d) / "nvidia-smi").exists() for d in ("/usr/bin", "/bin")):
        pytest.skip("this machine has nvidia-smi")
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "use --dry-run" in done.stderr


def test_mfu_divides_by_the_named_gpus_dense_bf16_peak():
    from strop.bench.gpu_check import peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3") == peak_flops("NVIDIA H200") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("cpu") is None and peak_flops("Tesla T4") is None  # unknown: no MFU, not a guess
