"""Experiment tracking: the metrics rows every stage writes to its `metrics.jsonl`, also sent to
Weights & Biases, TensorBoard and MLflow through their own client libraries (config `[log]`; each an
optional extra, none by default). With none configured the tracker is a null object, so training
loops never branch on it.

A stage's tracker opens its backends on the first row it logs, so a process that never logs (a
sharded trainer's other ranks) starts no W&B run. Each stage is one run in each backend, named
`<run.name>-<stage>` and grouped by `run.name`. Rows are flattened to numbers: nested dicts become
`a/b` keys, booleans 0/1; strings, lists and None are left to the JSONL.

Not covered: a resumed stage logs the steps after its checkpoint again (the JSONL drops the old
rows; W&B ignores a step it has seen, TensorBoard and MLflow show both).
"""

import dataclasses
import os
from pathlib import Path
from typing import Protocol

from strop.config import Config, LogSection, dotted
from strop.errors import UserError


class Tracker(Protocol):
    def log(self, row: dict, step: int) -> None: ...
    def trajectories(self, step: int, records: list[dict]) -> None: ...  # rollout records (strop.rl.rollout_log)
    def close(self) -> None: ...


class NullTracker:
    """Tracking off: every call does nothing."""

    def log(self, row: dict, step: int) -> None:
        pass

    def trajectories(self, step: int, records: list[dict]) -> None:
        pass

    def close(self) -> None:
        pass


def scalars(row: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics row, nested dicts flattened to `a/b` keys."""
    out: dict[str, float] = {}
    for k, v in row.items():
        if isinstance(v, dict):
            out.update(scalars(v, f"{prefix}{k}/"))
        elif isinstance(v, bool):
            out[prefix + k] = float(v)
        elif isinstance(v, (int, float)):
            out[prefix + k] = float(v)
    return out


def _missing(key: str) -> UserError:
    """The error for a tracker whose package is not installed (each key is its module's and extra's name)."""
    return UserError(f"config key 'log.{key}' is true but {key!r} is not installed: pip install 'strop[{key}]'")


def transcript(record: dict, max_chars: int = 4000) -> str:
    """A rollout record's messages as plain text (the W&B table's cell)."""
    parts = []
    for seg in record.get("segments", []):
        for m in seg.get("messages", []):
            text = m.get("content") or ""
            calls = " ".join(f"{c['function']['name']}({c['function']['arguments']})" for c in m.get("tool_calls", []))
            parts.append(f"[{m['role']}] {text} {calls}".strip())
    text = "\n".join(parts)
    return text if len(text) <= max_chars else text[: max_chars - 12] + "\n[truncated]"


class WandbTracker:
    def __init__(self, log: LogSection, run_dir: Path, run_name: str, stage: str, config: dict):
        import wandb

        self.wandb, self.every = wandb, log.trajectories_every
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=log.wandb_project,
            entity=log.wandb_entity or None,
            mode=log.wandb_mode,
            dir=str(run_dir),
            group=run_name,
            job_type=stage,
            name=f"{run_name}-{stage}",
            config=config,
            reinit="create_new",  # the demo's stages are runs of their own, one after another in one process
            settings=wandb.Settings(console="off", quiet=True),
        )

    def log(self, row: dict, step: int) -> None:
        self.run.log(scalars(row), step=step)

    def trajectories(self, step: int, records: list[dict]) -> None:
        if not self.every or step % self.every:
            return
        columns = ["step", "task", "group", "sample", "reward", "advantage", "stop_reason", "hack_flags", "transcript"]
        table = self.wandb.Table(columns=columns)
        for r in records:
            flags = ",".join(f["kind"] for f in r.get("hack_flags", []))
            table.add_data(
                step,
                r["task_id"],
                r["group_id"],
                r["sample"],
                r["reward"],
                r.get("advantage"),
                r["stop_reason"],
                flags,
                transcript(r),
            )
        self.run.log({"trajectories": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    def __init__(self, run_dir: Path, stage: str):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard" / stage))

    def log(self, row: dict, step: int) -> None:
        for k, v in scalars(row).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()  # a killed run keeps what it logged

    def trajectories(self, step: int, records: list[dict]) -> None:
        pass

    def close(self) -> None:
        self.writer.close()


class MlflowTracker:
    def __init__(self, log: LogSection, run_dir: Path, run_name: str, stage: str, config: dict):
        uri = log.mlflow_uri
        if not uri:
            # MLflow keeps its file store working but refuses it unless asked: the default here is a
            # directory beside the run's other outputs, readable with `mlflow ui --backend-store-uri`.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(run_name)
        exp_id = experiment.experiment_id if experiment else self.client.create_experiment(run_name)
        self.run_id = self.client.create_run(exp_id, run_name=f"{run_name}-{stage}", tags={"stage": stage}).info.run_id
        params = [Param(k, str(v)[:500]) for k, v in dotted(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, row: dict, step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars(row).items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def trajectories(self, step: int, records: list[dict]) -> None:
        pass

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class StageTracker:
    """The backends `[log]` asks for, opened at the first row a stage logs; `close` ends them."""

    def __init__(self, cfg: Config, stage: str):
        self.cfg, self.stage = cfg, stage
        self.backends: list[Tracker] | None = None

    def _open(self) -> list[Tracker]:
        if self.backends is None:
            log, run_dir, name = self.cfg.log, self.cfg.run_dir, self.cfg.run.name
            config = dataclasses.asdict(self.cfg)
            self.backends = []
            if log.wandb:
                self.backends.append(WandbTracker(log, run_dir, name, self.stage, config))
            if log.tensorboard:
                self.backends.append(TensorBoardTracker(run_dir, self.stage))
            if log.mlflow:
                self.backends.append(MlflowTracker(log, run_dir, name, self.stage, config))
        return self.backends

    def log(self, row: dict, step: int) -> None:
        row = {k: v for k, v in row.items() if k != "step"}  # the x-axis, not a metric
        for b in self._open():
            b.log(row, step)

    def trajectories(self, step: int, records: list[dict]) -> None:
        for b in self._open():
            b.trajectories(step, records)

    def close(self) -> None:
        for b in self.backends or []:
            b.close()
        self.backends = None


def open_tracker(cfg: Config, stage: str) -> Tracker:
    """The tracker of one stage (`midtrain`, `sft`, `rl`, ...): a null object when `[log]` asks for none."""
    import importlib.util

    log = cfg.log
    wanted = [key for key in ("wandb", "tensorboard", "mlflow") if getattr(log, key)]
    for key in wanted:  # refused before the stage's work, not at its first row
        if importlib.util.find_spec(key) is None:
            raise _missing(key)
    return StageTracker(cfg, stage) if wanted else NullTracker()
