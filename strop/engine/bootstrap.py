"""An engine's policy from the weight store, on a node that holds no copy of it.

The trainer puts its policy's small files (config, tokenizer, chat template: everything in the
model directory but the weights) into the store beside the weights (`publish_policy_files`). An
engine anywhere then needs only the store's URL:

1. `policy_files` writes those files into a directory of the engine's own;
2. `zero_policy` builds the model from the config with every parameter zero (on the meta
   device, then storage: no random init to pay for);
3. its weight sync does the rest: a receiver that starts at version -1 fetches exactly the tensors
   whose checksum differs from the store's (every tensor that is not all zeros) and then walks
   the chain (`strop.sync.apply.EngineSync`), so the engine serves the trainer's bf16 snapshot bit
   for bit.

A server that must load a checkpoint directory to start (vLLM) gets one written from the store's
latest version instead (`checkpoint_from_store`), per-expert tensors named as on disk.
"""

from pathlib import Path

import numpy as np
import torch

from strop.sync.store import Store
from strop.sync.tensors import Tensor

WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth")  # never put in the store


def publish_policy_files(store: Store, policy_dir: str | Path) -> None:
    """Put every file of the model directory but its weights into `store` (config, tokenizer, ...)."""
    files = sorted(p for p in Path(policy_dir).iterdir() if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES))
    store.put_files({p.name: p.read_bytes() for p in files})


def policy_files(store_url: str, dest: Path) -> Path:
    """The policy's files from the store, written into `dest` (made): a model directory without
    weights, enough for its config and tokenizer."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, data in Store(store_url).files().items():
        (dest / name).write_bytes(data)
    return dest


def zero_policy(path: Path):
    """The policy of the config in `path`, on the CPU, every parameter zero (fp32), in eval mode."""
    from transformers import AutoConfig

    from strop.model.meta import build_on_meta, materialize

    model = build_on_meta(AutoConfig.from_pretrained(str(path)))
    materialize(model, "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model.eval()


def as_torch(t: Tensor) -> torch.Tensor:
    """A store tensor (bit patterns) as a torch tensor of its dtype, sharing memory."""
    dtypes = {"BF16": (np.int16, torch.bfloat16), "F16": (np.int16, torch.float16), "F32": (np.int32, torch.float32)}
    as_int, dtype = dtypes[t.dtype]
    return torch.from_numpy(t.data.view(as_int)).view(dtype).reshape(t.shape)


def latest_weights(store_url: str) -> tuple[int, dict[str, torch.Tensor]]:
    """The store's latest version and its tensors (as published: bf16) by the trainer's names."""
    store = Store(store_url)
    version = store.head()["latest"]
    return version, {name: as_torch(t) for name, t in store.state(version).items()}


def checkpoint_from_store(store_url: str, dest: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """Write into `dest` a model directory of the store's latest version: the policy's files and
    its weights as they are published (bf16), per-expert names as checkpoints hold them. Returns
    the version and its tensors by the trainer's names."""
    from safetensors.torch import save_file

    from strop.model.checkpoint_names import split_experts

    policy_files(store_url, dest)
    version, tensors = latest_weights(store_url)
    save_file({k: t.contiguous() for k, t in split_experts(tensors).items()}, str(dest / "model.safetensors"))
    return version, tensors
