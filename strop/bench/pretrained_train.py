"""`strop bench pretrained-train`: what a training step of a real pretrained model costs on this CPU,
and what its weight deltas cost on the wire.

The model is a directory `strop model import` wrote (SmolLM2-135M-Instruct by default:
`--checkpoint $(strop model import)`). Each variant runs in a fresh process (so its peak memory is
its own): a batch of `--batch` rows of `--seq-len` tokens of real code (the standard library's
held-out files in the model's own tokenizer), the loss on each row's second half as RL's loss covers
the policy's own tokens (the output head only there, `strop.model.policy.logits_at`), AdamW; one
warm-up step, then `--steps` timed (best reported, tokens/s = batch x seq-len over it; over the
process's CPU time too, the steadier figure on a shared machine). Variants:

  full            every parameter, fp32, AdamW (lr 1e-6, an RL step)
  checkpointing   full, each decoder layer's activations recomputed in the backward
                  (`trainer.activation_checkpointing`)
  deterministic   full, under `deterministic_mode` (the batch-invariant kernels the engine runs:
                  the bitwise mode's cost on the trainer's side)
  frozen          the embeddings (tied to the head) and the lower two thirds of the layers frozen
  lora            peft LoRA adapters (rank 16, alpha 32, every attention and MLP projection; lr
                  2e-5); `publish_s` merges them into the weights, takes the bf16 snapshot an engine
                  is sent, and unmerges

Deltas: for `full` and `lora`, the bf16 snapshots after the last two steps go through the weight
codec (`strop.sync.codec`) and zstd-of-XOR (`strop.bench.sync`): bytes, ratio to raw bf16, whether
decoding gave the new weights back bit for bit.
"""

import argparse
import multiprocessing
import resource
import time
from concurrent.futures import ProcessPoolExecutor

from strop.bench.table import format_table, write_json
from strop.cpu import model_name as cpu_model_name

VARIANTS = {
    "full": {},
    "checkpointing": {"checkpointing": True},
    "deterministic": {"deterministic": True},
    "frozen": {"frozen": 2 / 3},
    "lora": {"lora_rank": 16},
}
LR = {"lora": 2e-5}  # others 1e-6
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="model directory, e.g. $(strop model import)")
    p.add_argument("--batch", type=int, default=4, help="rows per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row")
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant (after one warm-up step)")
    p.add_argument("--quick", action="store_true", help="2 rows of 128 tokens, 1 timed step")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0 = STROP_THREADS or all cores)")
    p.add_argument("--json", help="write results to this JSON file")


def _batch(tokenizer, batch: int, seq_len: int):
    """(input ids [B, T], loss mask [B, T]: the second half of each row but its last position)."""
    import numpy as np
    import torch

    from strop.config import DataSection
    from strop.data.corpus import load_corpus
    from strop.data.packing import tokenize_documents

    stream = tokenize_documents(tokenizer, load_corpus(DataSection()).val, limit=batch * seq_len + 1)
    starts = np.random.default_rng(0).integers(0, len(stream) - seq_len, batch)
    ids = torch.tensor(np.stack([stream[s : s + seq_len] for s in starts]), dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, seq_len // 2 : -1] = True
    return ids, mask


def _snapshot(model) -> dict:
    """The bf16 bit patterns an engine would be sent: every base weight once (LoRA adapters merged in
    by the caller, their own tensors left out), by its plain model name."""
    import torch

    from strop.sync.apply import bits_view

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out, seen = {}, set()
    for name, t in base.state_dict().items():
        if "lora_" in name or t.data_ptr() in seen:  # a tied head is the embedding: sent once
            continue
        seen.add(t.data_ptr())
        out[name.replace(".base_layer.", ".")] = bits_view(t.detach().to(torch.bfloat16).contiguous())
    return out


def _variant(checkpoint: str, name: str, batch: int, seq_len: int, steps: int, threads: int | None) -> dict:
    """One variant's steps in this (fresh) process: times, peak memory, and for full and lora the
    snapshots of the last two versions."""
    from strop.threads import set_threads

    set_threads(threads)
    import contextlib

    import torch
    import torch.nn.functional as F

    from strop.data.tokenizer import load_tokenizer
    from strop.model.deterministic import deterministic_mode
    from strop.model.policy import load_model, logits_at
    from strop.train.device import checkpoint_activations, freeze_lower

    spec = VARIANTS[name]
    torch.manual_seed(0)
    model = load_model(checkpoint).train()
    ids, mask = _batch(load_tokenizer(checkpoint), batch, seq_len)
    targets = ids[:, 1:][mask[:, :-1]]
    if spec.get("checkpointing"):
        checkpoint_activations(model)
    freeze_lower(model, spec.get("frozen", 0.0))
    if "lora_rank" in spec:
        from peft import LoraConfig, get_peft_model

        rank = spec["lora_rank"]
        config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=LORA_TARGETS)
        model = get_peft_model(model, config)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR.get(name, 1e-6), weight_decay=0.0)
    mode = deterministic_mode(model) if spec.get("deterministic") else contextlib.nullcontext()
    times, cpu, publish, snaps = [], [], [], []
    with mode:
        for step in range(steps + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            loss = F.cross_entropy(logits_at(model, ids, mask), targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            if name in ("full", "lora") and step >= steps - 1:
                t0 = time.perf_counter()
                if name == "lora":
                    model.merge_adapter()
                snaps.append(_snapshot(model))
                if name == "lora":
                    model.unmerge_adapter()
                publish.append(time.perf_counter() - t0)
    return {
        "variant": name,
        "step_s": min(times),
        "tok_s": batch * seq_len / min(times),
        "cpu_step_s": min(cpu),
        "cpu_tok_s": batch * seq_len / min(cpu),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "trainable_m": sum(p.numel() for p in params) / 1e6,
        "loss": float(loss.detach()),
        "publish_s": min(publish) if publish else None,
        "snapshots": snaps[-2:],
    }


def run(args: argparse.Namespace) -> int:
    from strop.bench.sync import codec_rows
    from strop.errors import UserError
    from strop.model.policy import load_model_config

    names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise UserError(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    load_model_config(args.checkpoint)  # a bad directory: one line, before any child starts
    batch, seq_len, steps = (2, 128, 1) if args.quick else (args.batch, args.seq_len, args.steps)
    if min(batch, seq_len, steps) < 1 or seq_len < 8:
        raise UserError("--batch, --steps must be at least 1 and --seq-len at least 8")
    threads = args.threads or None
    rows, deltas = [], []
    spawn = multiprocessing.get_context("spawn")
    for name in names:
        with ProcessPoolExecutor(1, mp_context=spawn) as pool:  # a fresh process per variant: its own peak memory
            out = pool.submit(_variant, args.checkpoint, name, batch, seq_len, steps, threads).result()
        snaps = out.pop("snapshots")
        rows.append(out)
        print(f"  {name}: {out['step_s']:.1f} s/step, peak {out['peak_rss_mib']:.0f} MiB", flush=True)
        if len(snaps) == 2:
            for r in codec_rows(name, *snaps, 1):
                if r["method"] in ("raw-bf16", "zstd-xor", "strop"):
                    deltas.append({k: r[k] for k in ("case", "method", "bytes", "ratio", "bit_exact")})
    full = next((r for r in rows if r["variant"] == "full"), None)
    for r in rows:  # CPU time: the steadier comparison on a machine other jobs share
        r["cpu_vs_full"] = r["cpu_tok_s"] / full["cpu_tok_s"] if full else None
    result = {
        "model": args.checkpoint,
        "batch": batch,
        "seq_len": seq_len,
        "timed_steps": steps,
        "threads": threads or "all",
        "cpu": cpu_model_name(),
        "rows": rows,
        "deltas": deltas,
    }
    for r in rows:
        result[f"{r['variant']}_tok_s"] = r["tok_s"]
        result[f"{r['variant']}_cpu_tok_s"] = r["cpu_tok_s"]
    by = {(d["case"], d["method"]): d for d in deltas}
    for case in ("full", "lora"):
        if (case, "strop") in by:
            result[f"{case}_delta_ratio"] = by[case, "strop"]["ratio"]
            result[f"{case}_delta_vs_zstd_xor"] = by[case, "strop"]["ratio"] / by[case, "zstd-xor"]["ratio"]
            result[f"{case}_delta_lossless"] = by[case, "strop"]["bit_exact"]
    print(
        f"training steps of {args.checkpoint}: {batch} x {seq_len} tokens of code per step (loss on each row's "
        f"second half), AdamW, best of {steps} after a warm-up, {result['threads']} thread(s), {result['cpu']}"
    )
    columns = ["variant", "step_s", "tok_s", "cpu_tok_s", "cpu_vs_full", "peak_rss_mib", "trainable_m", "publish_s"]
    print(format_table(rows, [*columns, "loss"]))
    if deltas:
        print("weight deltas between the last two versions (bf16 snapshots an engine is sent):")
        print(format_table(deltas, ["case", "method", "bytes", "ratio", "bit_exact"]))
    write_json(args.json, result)
    return 0
