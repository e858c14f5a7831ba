"""Run reports: metrics as JSONL (one object per step) and PNG plots of them."""

import json
from pathlib import Path

from strop.outputs import write_atomic
from strop.tracking import NullTracker, Tracker


class MetricsLog:
    """Append-only JSONL metrics file that a resumed run trims back to its checkpoint step. Each row
    also goes to `tracker` (W&B, TensorBoard, MLflow: `strop.tracking.open_tracker`)."""

    def __init__(self, path: Path, tracker: Tracker | None = None):
        self.path = Path(path)
        self.tracker = tracker or NullTracker()

    def reset(self) -> None:
        self.path.write_text("")

    def write(self, row: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.tracker.log(row, int(row.get("step", 0)))

    def close(self) -> None:
        """Ends the tracker's runs (the JSONL needs no closing)."""
        self.tracker.close()

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """Drop rows past `step` (written after the last checkpoint by a killed run)."""
        if not self.path.is_file():
            return
        rows = [r for r in self.read() if r.get("step", 0) <= step]
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in rows))


def moving_average(ys: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values (the first values average what there is)."""
    return [sum(ys[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(ys))]


def plot_metrics(
    rows: list[dict],
    path: Path,
    keys: list[str],
    title: str = "",
    x: str = "step",
    ylabel: str = "",
    points: dict[str, tuple[float, float, float, float]] | None = None,
    smooth: int = 0,
) -> None:
    """One line per key against `x`; rows missing a key are skipped for that line. `points` adds
    labelled markers with error bars: label -> (x, y, low, high). With `smooth` > 1 each key is
    drawn thin as measured and bold as its moving average over that many rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in keys:
        pts = [(r[x], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            xs, ys = zip(*pts)
            if smooth > 1:
                (line,) = ax.plot(xs, ys, alpha=0.35, linewidth=1)
                ax.plot(
                    xs,
                    moving_average(list(ys), smooth),
                    color=line.get_color(),
                    linewidth=2.2,
                    label=f"{key} (mean of {smooth} steps)",
                )
            else:
                ax.plot(xs, ys, label=key, marker="o" if len(pts) < 30 else None)
    for label, (px, py, lo, hi) in (points or {}).items():
        ax.errorbar([px], [py], yerr=[[py - lo], [hi - py]], fmt="s", capsize=4, label=label)
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
