"""Mid-training sharded over ranks (`trainer.parallel.fsdp`) against one process on the tiny MoE:
the same batches give the same losses and weights (to float32 rounding: the ranks' gradients and
the clipped norm are summed in another order), and a checkpoint written by N ranks, each its own
shards, resumes at another rank count."""

import json

import pytest
import torch
from safetensors.torch import load_file

from strop.config import load_config
from strop.train.midtrain import midtrain
from tests.test_midtrain import tiny_run_toml

# Per-weight bound after a few AdamW steps at lr 3e-4: a rounding difference in a gradient moves
# an Adam update by up to about lr, so this is far below one step's size but far above noise.
WEIGHT_TOL = 2e-5


def config(tmp_path, name: str, ranks: int, steps: int = 6):
    path = tmp_path / f"{name}.toml"
    path.write_text(tiny_run_toml(tmp_path, name, steps=steps).replace("ckpt_every = 4", "ckpt_every = 2"))
    return load_config(path, overrides=[f"trainer.parallel.fsdp={ranks}"])


def losses(cfg) -> list[float]:
    rows = [json.loads(line) for line in (cfg.run_dir / "midtrain" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


def weights(cfg) -> dict[str, torch.Tensor]:
    return load_file(str(cfg.run_dir / "midtrain" / "model" / "model.safetensors"))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def run_and_compare(tmp_path, counts: tuple[int, ...]) -> None:
    one = config(tmp_path, "one", 1)
    midtrain(one)
    for n in counts:
        cfg = config(tmp_path, f"ranks{n}", n)
        result = midtrain(cfg)
        assert result["ranks"] == n and result["steps"] == 6
        assert losses(cfg) == pytest.approx(losses(one), rel=1e-5)
        diff = max_diff(weights(cfg), weights(one))
        print(f"{n} ranks: max |w - w_single| after 6 steps = {diff:.3g}")
        assert diff < WEIGHT_TOL


def resume_at_another_count(tmp_path, first: int, then: int) -> None:
    """`first` ranks stop after 3 steps (their last checkpoint: step 2); `then` ranks resume it
    and end where an uninterrupted single-process run ends."""
    one = config(tmp_path, "one", 1)
    midtrain(one)
    cfg = config(tmp_path, "moved", first)
    assert midtrain(cfg, stop_after=3) == {"stopped_at": 3}
    shards = sorted(p.name for p in (cfg.run_dir / "midtrain" / "ckpt" / "shards").iterdir())
    assert shards == [".metadata"] + [f"__{r}_0.distcp" for r in range(first)]  # a file per rank, a manifest
    resumed = config(tmp_path, "moved", then)
    assert midtrain(resumed)["ranks"] == then
    assert losses(resumed) == pytest.approx(losses(one), rel=1e-5)
    assert max_diff(weights(resumed), weights(one)) < WEIGHT_TOL


def test_two_ranks_midtrain_as_one_process(tmp_path):
    run_and_compare(tmp_path, (2,))


def test_a_two_rank_checkpoint_resumes_in_one_process(tmp_path):
    resume_at_another_count(tmp_path, 2, 1)


@pytest.mark.slow
def test_four_ranks_midtrain_as_one_process(tmp_path):
    run_and_compare(tmp_path, (4,))


@pytest.mark.slow
def test_a_two_rank_checkpoint_resumes_on_four(tmp_path):
    resume_at_another_count(tmp_path, 2, 4)
