"""The figures of `scripts/gpu_check.sh`, from the runs it leaves in OUT_DIR, as one JSON object:

    python -m strop.bench.gpu_check OUT_DIR      # prints the JSON and writes OUT_DIR/summary.json

- per stage (mid-training, SFT, RL's trainer): tokens/s, MFU and peak memory of the trainer
  (`peak_mem_mib`: GPU memory torch allocated on CUDA, the process's peak RSS on the CPU);
- RL: rollout tokens/s, the trainer's publish seconds per version and the whole weight sync
  (`weight_sync_s`: from a version's publication to the last engine serving it, `strop train`'s
  result), and the engine/trainer logprob mismatch;
- routing (from `strop bench engine --backend vllm`, when the check ran it): vLLM's rollout tokens/s
  and how many MoE routing decisions flip between vLLM and the trainer without and with replay.

MFU = 6 x active parameters x tokens/s / the GPU's peak dense bf16 FLOP/s: active parameters leave
out the embedding table (a lookup) and the experts a token does not use (1 - top_k / experts of
them); the attention scores' sequence-length term is left out (small at these lengths), so MFU is a
slight undercount. The peak comes from `PEAK_BF16_TFLOPS` by the GPU's name: null for a GPU not
in it, and on the CPU (the dry run).
"""

import json
import statistics
import sys
from pathlib import Path

# Dense bf16 tensor-core peaks from the vendors' data sheets (TFLOP/s, without sparsity), matched by name.
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.4, "A100": 312.0, "L40S": 362.0}


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def peak_flops(name: str) -> float | None:
    """Peak dense bf16 FLOP/s of the GPU called `name` (the first key of `PEAK_BF16_TFLOPS` in it)."""
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)


def active_params(model_dir: Path) -> int:
    """Parameters a token's forward multiplies by (see the module docstring), from the saved config."""
    from transformers import AutoConfig

    from strop.model.meta import build_on_meta

    config = AutoConfig.from_pretrained(str(model_dir))
    model = build_on_meta(config)
    experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    total = 0
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight") and not config.tie_word_embeddings:
            continue  # a lookup; tied, it is the output head's matmul too (listed once)
        share = config.num_experts_per_tok / experts if experts and ".experts." in name + "." else 1.0
        total += int(p.numel() * share)
    return total


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def summarize(out: Path) -> dict:
    """The check's figures from OUT_DIR (layout of `scripts/gpu_check.sh`)."""
    name = device_name()
    peak = peak_flops(name)
    n_active = active_params(out / "gpu_check" / "sft" / "model")

    def mfu(tokens_per_s: float | None) -> float | None:
        return round(6 * n_active * tokens_per_s / peak, 5) if peak and tokens_per_s else None

    runs = out / "gpu_check"
    midtrain = json.loads((runs / "midtrain" / "model" / "strop.json").read_text())["midtrain"]
    sft = json.loads((runs / "sft" / "result.json").read_text())
    sft_rows = [r for r in _rows(runs / "sft" / "metrics.jsonl") if "tok_s" in r]
    rl = json.loads((out / "rl" / "result.json").read_text())
    rl_rows = _rows(out / "rl" / "metrics.jsonl")
    trainer_tok_s = statistics.median(r["tokens_per_s"] for r in rl_rows)
    summary = {
        "device": name,
        "peak_bf16_tflops": peak / 1e12 if peak else None,
        "active_params": n_active,
        "midtrain": {
            "device": midtrain["device"],
            "precision": midtrain["precision"],
            "tokens_per_s": midtrain["tok_s"],
            "mfu": mfu(midtrain["tok_s"]),
            "peak_mem_mib": midtrain["peak_mem_mib"],
        },
        "sft": {
            "device": sft["device"],
            "tokens_per_s": sft_rows[-1]["tok_s"] if sft_rows else None,
            "mfu": mfu(sft_rows[-1]["tok_s"] if sft_rows else None),
            "peak_mem_mib": sft["peak_mem_mib"],
        },
        "rl": {
            "steps": len(rl_rows),
            "trainer_tokens_per_s": trainer_tok_s,
            "mfu": mfu(trainer_tok_s),
            "rollout_tokens_per_s": statistics.median(r["rollout_tokens_per_s"] for r in rl_rows),
            "publish_s": statistics.median(r["publish_s"] for r in rl_rows),
            "weight_sync_s": rl.get("weight_sync_s"),
            "peak_mem_mib": max(r["peak_mem_mib"] for r in rl_rows),
            "mismatch_mean_abs_dlogp": statistics.median(r["mismatch_mean_abs_dlogp"] for r in rl_rows),
        },
    }
    bench = out / "bench.json"
    if bench.is_file():
        b = json.loads(bench.read_text())
        summary["routing"] = {
            "vllm_tok_s_bs16": b.get("vllm_tok_s_bs16"),
            "flips_without_replay": b.get("vllm_flips_without_replay"),
            "flips_with_replay": b.get("vllm_replay_flips"),
            "vllm_mean_abs_dlogp": b.get("vllm_mean_abs_dlogp"),
        }
    return summary


def main(argv: list[str]) -> int:
    from strop.threads import set_threads

    set_threads(1)
    out = Path(argv[0])
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
