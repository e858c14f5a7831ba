"""Where a trainer computes, and in what precision: the `[trainer]` section made concrete.

- **Device** (`trainer.device`): `auto` is CUDA when torch finds a GPU, else the CPU; `cuda` where
  torch finds none is a `UserError` (one line, exit 2), raised before any model loads. A rank of a
  sharded trainer takes GPU `rank % count` of its machine (under Ray each rank actor sees the one
  GPU it was given, as GPU 0). The process group's backend follows the device: gloo for CPU ranks;
  for CUDA ranks NCCL for tensors and gloo beside it for the pickled objects the ranks exchange
  (samples, metrics), which live in host memory.
- **Precision** (`trainer.precision`): `bf16` runs the forward and backward under bf16 autocast
  (matmuls in bf16, reductions and the loss in fp32) while the master weights, gradients and AdamW
  state stay fp32, as torchtitan and prime-rl train; `auto` is bf16 on CUDA and fp32 on the CPU, so
  CPU runs stay bit-repeatable. FSDP gathers fp32 parameters (autocast casts them per matmul), so
  N ranks compute what one process does.
- **Activation checkpointing** (`trainer.activation_checkpointing`): each decoder layer's
  activations are recomputed in the backward pass (transformers' own, non-reentrant checkpoint), a
  transform applied to the model from outside, before it is sharded.
- **Frozen layers** (`trainer.frozen_layers`): the embeddings and the lower layers are not trained,
  which on a CPU nearly halves a pretrained model's step at 2/3 frozen (`strop bench
  pretrained-train`: 1.81x the CPU-time tokens/s of a full step, where LoRA r16 gave 1.35x). The
  engines are still sent whole snapshots; the frozen part's deltas are zero, which the weight codec
  sends for next to nothing.

strop's C kernels are CPU code: nothing here routes a CUDA tensor to them (`strop.model.deterministic`
refuses a model that is not on the CPU, and the engine then takes its torch path).
"""

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch

from strop.config import TrainerSection
from strop.errors import UserError


def device_type(section: TrainerSection) -> str:
    """The device kind `trainer.device` asks for on this machine, "cuda" or "cpu"; UserError for
    cuda where torch finds no GPU."""
    if section.device == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"config key 'trainer.device' is 'cuda', but torch {torch.__version__} finds no CUDA device on this "
            "machine; set trainer.device = 'auto' or 'cpu'"
        )
    return "cuda" if section.device == "cuda" or (section.device == "auto" and torch.cuda.is_available()) else "cpu"


def rank_device(kind: str, rank: int = 0) -> torch.device:
    """The device rank `rank` computes on: the CPU, or GPU `rank % count` of this machine (made current)."""
    if kind == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def backend(kind: str) -> str:
    """The process-group backend for ranks on `kind` devices (see the module docstring)."""
    return "cpu:gloo,cuda:nccl" if kind == "cuda" else "gloo"


@dataclass(frozen=True)
class Precision:
    """How a trainer's forward and backward compute on `device`: bf16 autocast or all fp32."""

    bf16: bool = False

    @classmethod
    def of(cls, section: TrainerSection, kind: str) -> "Precision":
        return cls(bf16=section.precision == "bf16" or (section.precision == "auto" and kind == "cuda"))

    def autocast(self, device: torch.device) -> ContextManager:
        """Around a forward (and its loss): bf16 autocast on `device`, or nothing."""
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=torch.bfloat16)


def checkpoint_activations(model) -> None:
    """Recompute each decoder layer's activations in the backward pass (transformers' activation
    checkpointing, non-reentrant: it composes with FSDP2, whose hooks run again in the recompute,
    and with router replay, which replays the same experts there; see `strop.model.routing`)."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def freeze_lower(model, fraction: float) -> int:
    """Freeze the input embeddings (and so a head tied to them) and the lowest `fraction` of the
    decoder layers (`trainer.frozen_layers`): they get no gradients and no optimizer state, and the
    backward stops at the first trainable layer. Returns how many layers were frozen."""
    if fraction <= 0:
        return 0
    layers = model.model.layers
    n = round(len(layers) * fraction)
    for module in [model.get_input_embeddings(), *layers[:n]]:
        module.requires_grad_(False)
    return n


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory this process has used on `device`: allocated GPU memory (torch's allocator), or
    the process's peak resident set on the CPU (torch included)."""
    import resource

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
