"""Mid-training resumes exactly: a run killed at a random moment and rerun with the same command
ends with the same weights, bit for bit, as an uninterrupted run."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from strop.data.corpus import stdlib_dir

REPO = Path(__file__).resolve().parents[1]


def tiny_run_toml(out_dir: Path, name: str, steps: int = 30) -> str:
    lib = stdlib_dir()
    return f"""
[run]
out_dir = "{out_dir}"
name = "{name}"
threads = 1
[model]
hidden_size = 32
num_layers = 2
num_heads = 2
num_kv_heads = 1
head_dim = 16
num_experts = 8
experts_per_token = 2
expert_size = 16
dense_size = 64
[data]
stdlib = false
dirs = ["{lib / "json"}", "{lib / "email"}"]
val_files = 3
vocab_size = 400
seq_len = 32
[midtrain]
steps = {steps}
batch_size = 4
warmup_steps = 3
ckpt_every = 4
eval_every = 10
eval_batches = 1
"""


def strop(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "STROP_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(
        [sys.executable, "-m", "strop.cli", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def test_killed_run_resumes_bit_for_bit(tmp_path):
    full = tmp_path / "full.toml"
    # long enough that a kill up to 0.3 s after the first checkpoint lands mid-run on a fast machine too
    full.write_text(tiny_run_toml(tmp_path, "full", steps=100))
    killed = tmp_path / "killed.toml"
    killed.write_text(tiny_run_toml(tmp_path, "killed", steps=100))

    ref = strop("midtrain", "-c", str(full))
    assert ref.wait(timeout=300) == 0, ref.stderr.read()

    proc = strop("midtrain", "-c", str(killed))
    ckpt = tmp_path / "killed" / "midtrain" / "ckpt"
    deadline = time.time() + 120
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(random.Random(os.getpid()).uniform(0.0, 0.3))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / "midtrain" / "model").exists(), "the run finished before it was killed"

    again = strop("midtrain", "-c", str(killed))
    assert again.wait(timeout=300) == 0, again.stderr.read()
    a = load_file(str(tmp_path / "full" / "midtrain" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "killed" / "midtrain" / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_budget_fits_the_step_count(tmp_path):
    from strop.config import load_config
    from strop.train.midtrain import midtrain, steps_for_budget

    cfg = load_config(None, ["midtrain.steps=1000", "midtrain.budget_s=60", "midtrain.probe_steps=4"])
    assert steps_for_budget(cfg, step_s=0.5, spent_s=2.0) == 4 + 116
    assert steps_for_budget(cfg, step_s=0.001, spent_s=2.0) == 1000  # steps stays an upper bound
    assert steps_for_budget(cfg, step_s=100.0, spent_s=2.0) == 4

    f = tmp_path / "b.toml"
    # 20,000 steps never fit in 3 s here, on any machine (a fast idle one ran 500 in time)
    f.write_text(
        tiny_run_toml(tmp_path, "b", steps=20_000).replace("warmup_steps = 3", "warmup_steps = 4\nbudget_s = 3")
    )
    result = midtrain(load_config(f))
    assert 4 <= result["steps"] < 20_000 and result["train_s"] < 30
