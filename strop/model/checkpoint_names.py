"""Checkpoint tensors under the names a live model holds them by.

On disk (strop's own `save_pretrained` output and every Hugging Face MoE checkpoint) each expert
of a MoE layer is three tensors, `<layer>.mlp.experts.<e>.{gate,up,down}_proj.weight`. Live,
transformers 5 fuses them per layer into `<layer>.mlp.experts.gate_up_proj` [experts, 2 x inter,
hidden] (each expert's gate rows, then its up rows) and `<layer>.mlp.experts.down_proj`
[experts, hidden, inter], as its own loader does for Qwen3-MoE and DeepSeek-V3 (a test checks the
result against `from_pretrained`). Every other name is the same in both places.
"""

import re

import torch

# (per-expert tensor on disk) -> fused live tensor: the one table of names that differ
PER_EXPERT = re.compile(r"(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with every layer's per-expert tensors replaced by its fused live pair; raises
    ValueError when a layer's experts are incomplete or of unequal shapes."""
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = PER_EXPERT.fullmatch(name)
        if m is None:
            out[name] = t
        else:
            layers.setdefault(m["experts"], {p: {} for p in PROJECTIONS})[m["proj"]][int(m["index"])] = t
    for experts, proj in layers.items():
        n = len(proj["down_proj"])
        if any(sorted(proj[p]) != list(range(n)) for p in PROJECTIONS) or n == 0:
            raise ValueError(
                f"{experts}: the checkpoint holds an incomplete set of experts "
                f"({', '.join(f'{len(proj[p])} {p}' for p in PROJECTIONS)})"
            )
        try:
            out[f"{experts}.gate_up_proj"] = torch.stack(
                [torch.cat([proj["gate_proj"][e], proj["up_proj"][e]]) for e in range(n)]
            )
            out[f"{experts}.down_proj"] = torch.stack([proj["down_proj"][e] for e in range(n)])
        except RuntimeError as e:  # unequal shapes across experts or projections
            raise ValueError(f"{experts}: expert tensors of unequal shapes ({e})") from None
    return out


FUSED = re.compile(r"(?P<experts>.+\.experts)\.(?P<fused>gate_up_proj|down_proj)")


def split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `fuse_experts`: every fused live pair as the per-expert tensors a checkpoint
    holds (what other engines' loaders read, vLLM's among them); every other name as it is."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = FUSED.fullmatch(name)
        if m is None:
            out[name] = t
        elif m["fused"] == "down_proj":
            for e in range(t.shape[0]):
                out[f"{m['experts']}.{e}.down_proj.weight"] = t[e]
        else:  # each expert's gate rows, then its up rows
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{m['experts']}.{e}.gate_proj.weight"] = gate[e]
                out[f"{m['experts']}.{e}.up_proj.weight"] = up[e]
    return out
