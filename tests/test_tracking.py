"""Experiment tracking (`[log]`): a mid-training run on the demo's config, shrunk to seconds, with
W&B (offline), TensorBoard and MLflow (a file store) all on; each backend's own files are read back
and hold exactly the numbers of the run's metrics.jsonl. With tracking off nothing is opened."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from strop.data.corpus import stdlib_dir

pytestmark = pytest.mark.xdist_group("tracking")  # its module fixture (a real run) is made once

REPO = Path(__file__).resolve().parents[1]
STEPS = 6


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    lib = stdlib_dir()
    sets = [
        f"run.out_dir={out}",
        "run.threads=1",
        "log.wandb=true",
        "log.wandb_mode=offline",
        "log.tensorboard=true",
        "log.mlflow=true",
        # the demo's model and data, shrunk
        "model.hidden_size=32",
        "model.num_layers=1",
        "model.num_heads=2",
        "model.num_kv_heads=1",
        "model.head_dim=16",
        "model.num_experts=4",
        "model.expert_size=16",
        "data.stdlib=false",
        f'data.dirs=["{lib / "json"}"]',
        "data.val_files=2",
        "data.vocab_size=300",
        "data.seq_len=32",
        f"midtrain.steps={STEPS}",
        "midtrain.batch_size=2",
        "midtrain.warmup_steps=2",
        "midtrain.eval_every=3",
        "midtrain.eval_batches=1",
    ]
    env = {**os.environ, "STROP_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_SILENT": "true"}
    proc = subprocess.run(
        [sys.executable, "-m", "strop.cli", "midtrain", "--config", "examples/demo.toml"]
        + [a for s in sets for a in ("--set", s)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "demo"


def logged(run_dir: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl as {key: {step: value}} (the numbers every backend must hold)."""
    rows = [json.loads(line) for line in (run_dir / "midtrain" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        for k, v in r.items():
            if k != "step":
                out.setdefault(k, {})[r["step"]] = float(v)
    assert {"loss", "val_loss", "lr", "tok_s"} <= out.keys()
    from strop.run_files import undocumented

    assert undocumented("midtrain", rows) == []  # the run-directory reference names every key
    return out


def wandb_records(path: Path):
    """The records of a W&B transaction log (.wandb): a LevelDB-style log of 32 KiB blocks after a
    7-byte header, each record a 7-byte header (crc32, length, type) and a protobuf Record."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and n == 0:
            break
        chunk, pos = data[pos : pos + n], pos + n
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_wandb_offline_holds_the_runs_metrics(run_dir):
    (run,) = (run_dir / "wandb").glob("offline-run-*")
    got: dict[str, dict[int, float]] = {}
    for record in wandb_records(next(run.glob("*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            for k, v in items.items():
                if not k.startswith("_"):
                    got.setdefault(k, {})[record.history.step.num] = float(v)
    assert got == logged(run_dir)


def test_tensorboard_event_files_hold_the_runs_metrics(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard" / "midtrain"))
    events.Reload()
    got = {k: {e.step: e.value for e in events.Scalars(k)} for k in events.Tags()["scalars"]}
    want = logged(run_dir)
    assert got.keys() == want.keys()
    for k in want:  # TensorBoard stores float32
        assert got[k] == pytest.approx(want[k], rel=1e-6), k


def test_mlflow_file_store_holds_the_runs_metrics(run_dir):
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("demo")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "demo-midtrain" and run.info.status == "FINISHED"
    assert run.data.params["midtrain.steps"] == str(STEPS)
    want = logged(run_dir)
    got = {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in want}
    assert got == want


def test_tracking_off_is_a_null_tracker_and_a_missing_package_is_a_user_error(monkeypatch):
    import importlib.util

    from strop.config import load_config
    from strop.errors import UserError
    from strop.tracking import NullTracker, open_tracker

    assert isinstance(open_tracker(load_config(None), "rl"), NullTracker)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(UserError, match=r"log\.mlflow.*pip install 'strop\[mlflow\]'"):
        open_tracker(load_config(None, ["log.mlflow=true"]), "rl")
