"""Device-aware training (`[trainer]`, `strop.train.device`) on this CPU-only machine: `auto` picks
the CPU, `cuda` is one line and exit 2 from every trainer command, bf16 autocast over fp32 master
weights is a config choice that runs here (CPU autocast), and activation checkpointing changes no
number, router replay included. The same code on a GPU is what `scripts/gpu_check.sh` runs."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from strop.config import Config, ParallelSection, RLSection, TrainerSection, load_config
from strop.model.policy import load_model
from strop.rl.orchestrator import router_replay
from strop.rl.trainer import RLTrainer
from strop.train.device import Precision, checkpoint_activations, device_type, freeze_lower
from strop.train.midtrain import midtrain
from tests.test_midtrain import REPO, tiny_run_toml
from tests.test_parallel import compare, step_batches

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@no_cuda
def test_auto_picks_the_cpu_and_precision_follows_the_device():
    assert device_type(TrainerSection()) == device_type(TrainerSection(device="cpu")) == "cpu"
    assert Precision.of(TrainerSection(), "cpu") == Precision(bf16=False)  # auto: fp32 on the CPU
    assert Precision.of(TrainerSection(), "cuda") == Precision(bf16=True)  # auto: bf16 on CUDA
    assert Precision.of(TrainerSection(precision="bf16"), "cpu") == Precision(bf16=True)


@no_cuda
@pytest.mark.parametrize(
    "command", [["midtrain"], ["sft", "--policy", "{policy}"], ["train", "--policy", "{policy}", "--out", "{out}"]]
)
def test_cuda_without_a_gpu_is_one_line_and_exit_2(command, tiny_policy_dir, tmp_path):
    argv = [a.format(policy=tiny_policy_dir, out=tmp_path / "rl") for a in command]
    done = subprocess.run(
        [sys.executable, "-m", "strop.cli", *argv, "--set", "trainer.device=cuda", "--set", f"run.out_dir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"strop: error: config key 'trainer.device' is 'cuda', but torch {torch.__version__} finds no CUDA device "
        "on this machine; set trainer.device = 'auto' or 'cpu'"
    ]


def _trained(policy_dir, batches, precision: Precision, checkpointing: bool = False) -> tuple[RLTrainer, list]:
    model = load_model(policy_dir)
    if checkpointing:
        checkpoint_activations(model)
    trainer = RLTrainer(
        model, RLSection(lr=1e-2, micro_batch=4), pad_id=0, replay_ctx=router_replay, precision=precision
    )
    return trainer, [trainer.step(b) for b in batches]


def test_bf16_autocast_computes_in_bf16_over_fp32_master_weights(tiny_policy_dir):
    batches = step_batches(tiny_policy_dir, [8, 8])
    fp32, fp32_rows = _trained(tiny_policy_dir, batches, Precision())
    trainer, rows = _trained(tiny_policy_dir, batches[:1], Precision(bf16=True))
    seen = []  # the dtype each attention projection computes in
    hook = trainer.model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    rows.append(trainer.step(batches[1]))
    hook.remove()
    assert seen and set(seen) == {torch.bfloat16}  # matmuls under autocast
    params = list(trainer.model.parameters())
    assert {p.dtype for p in params} == {torch.float32}  # master weights stay fp32
    assert {t.dtype for s in trainer.optimizer.state.values() for t in s.values() if t.dim()} == {torch.float32}
    # the same steps, in another precision: close, not the same
    w16, w32 = trainer.state_dict()["model"], fp32.state_dict()["model"]
    diff = max(float((w16[k] - w32[k]).abs().max()) for k in w32)
    assert 0 < diff < 0.05
    assert all(abs(a["loss"] - b["loss"]) < 0.05 for a, b in zip(rows, fp32_rows))
    # before any step the samples' own policy, recomputed: in bf16 further from the fp32 sampler's logprobs
    assert rows[0]["mismatch_mean_abs_dlogp"] > fp32_rows[0]["mismatch_mean_abs_dlogp"]


def test_activation_checkpointing_recomputes_through_router_replay_to_the_same_weights(tiny_policy_dir):
    batches = step_batches(tiny_policy_dir, [8, 8])
    plain, plain_rows = _trained(tiny_policy_dir, batches, Precision())
    checkpointed, rows = _trained(tiny_policy_dir, batches, Precision(), checkpointing=True)
    assert checkpointed.model.model.gradient_checkpointing and checkpointed.model.training
    a, b = plain.state_dict()["model"], checkpointed.state_dict()["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)  # the recompute replays the same experts: same numbers
    assert [r["loss"] for r in rows] == [r["loss"] for r in plain_rows]


def test_frozen_lower_layers_stay_put_and_hold_no_optimizer_state(tiny_policy_dir):
    """`trainer.frozen_layers`: the embeddings (tied to the head) and the lower layers keep their
    weights through RL steps and get no AdamW state; the layers above train."""
    batches = step_batches(tiny_policy_dir, [8, 8])
    model = load_model(tiny_policy_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    n = len(model.model.layers) - 1
    assert n >= 1 and freeze_lower(model, n / (n + 1)) == n and freeze_lower(model, 0.0) == 0
    trainer = RLTrainer(model, RLSection(lr=1e-2, micro_batch=4), pad_id=0, replay_ctx=router_replay)
    rows = [trainer.step(b) for b in batches]
    after = trainer.state_dict()["model"]
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(k.startswith(f"model.layers.{n}.") or k.startswith("model.norm") for k in moved), moved
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    assert frozen and not frozen & {id(p) for p in trainer.optimizer.state}
    assert all(r["loss"] == r["loss"] for r in rows)  # finite steps, not skipped


def test_two_checkpointed_ranks_train_as_one_process(tiny_policy_dir, tiny_tokenizer, tmp_path):
    """FSDP2 over gloo with activation checkpointing: the recompute in the backward gathers each
    layer's shards again and replays the same experts; the weights are one plain process's."""
    trainer = TrainerSection(ParallelSection(fsdp=2), activation_checkpointing=True)
    cfg = Config(rl=RLSection(lr=1e-2, micro_batch=4, grad_clip=0.0), trainer=trainer)
    steps = compare(cfg, tiny_policy_dir, tiny_tokenizer.pad_token_id, step_batches(tiny_policy_dir, [8, 8]), tmp_path)
    for one, two, w1, w2 in steps:
        assert one["loss"] == two["loss"] and all(torch.equal(w1[k], w2[k]) for k in w1)


def test_midtrain_in_bf16_and_with_activation_checkpointing(tmp_path):
    path = tmp_path / "bf16.toml"
    path.write_text(tiny_run_toml(tmp_path, "bf16", steps=3))
    cfg = load_config(path, overrides=["trainer.precision=bf16", "trainer.activation_checkpointing=true"])
    result = midtrain(cfg)
    assert result["precision"] == "bf16" and result["device"] == "cpu" and result["steps"] == 3
    assert result["train_loss"] == pytest.approx(result["train_loss"])  # finite
    fp32 = midtrain(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name="fp32"), trainer=TrainerSection()))
    assert fp32["precision"] == "fp32" and fp32["train_loss"] != result["train_loss"]
    assert abs(fp32["train_loss"] - result["train_loss"]) < 0.05


def test_the_c_kernels_never_take_a_model_off_the_cpu(tiny_moe):
    """Deterministic mode (and the engine's kernel path, which asks the same question) refuses a
    model whose tensors are not on the CPU: on a GPU the engine computes with torch."""
    from strop.model.deterministic import unsupported

    assert unsupported(tiny_moe) is None
    assert "CPU tensors only (the model is on meta)" in unsupported(tiny_moe.to("meta"))
