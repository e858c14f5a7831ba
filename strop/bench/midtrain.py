"""`strop bench midtrain`: mid-training throughput (tokens/s of forward + backward + AdamW step)
on this machine, for each supported architecture at the configured size, on real packed code; MoE
architectures once with strop's sorted experts forward and once with transformers' eager loop."""

import argparse
import time

from strop.bench.table import format_table, write_json
from strop.config import add_config_arguments, config_from_args
from strop.cpu import model_name as cpu_model_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per architecture (after 2 warmup steps)")
    parser.add_argument("--json", help="write results to this JSON file")
    parser.add_argument("--quick", action="store_true", help="2 timed steps, the configured architecture only")


def run(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from strop.data.corpus import load_corpus
    from strop.data.packing import PackedBatches, tokenize_documents
    from strop.data.tokenizer import train_tokenizer
    from strop.model.policy import build_model, experts_implementation
    from strop.threads import set_threads
    from strop.train.midtrain import lm_loss

    cfg = config_from_args(args)
    threads = set_threads(cfg.run.threads or None)
    steps = 2 if args.quick else args.steps
    corpus = load_corpus(cfg.data)
    tokenizer = train_tokenizer(corpus.train[:300], cfg.data.vocab_size, 2_000_000)
    tokens = tokenize_documents(tokenizer, corpus.train[:300])
    data = PackedBatches(tokens, cfg.data.seq_len, cfg.midtrain.batch_size, cfg.run.seed)
    archs = [cfg.model.arch] if args.quick else ["qwen3_moe", "deepseek_v3", "qwen3"]
    rows = []
    # MoE architectures with each experts forward; the dense one (no experts) once, as None.
    runs = [
        (arch, experts)
        for arch in archs
        for experts in (["eager", experts_implementation()] if arch != "qwen3" else [None])
    ]
    trained = []
    for arch, experts in runs:
        model = build_model(dataclasses.replace(cfg.model, arch=arch), tokenizer, cfg.run.seed).train()
        if experts:
            model.set_experts_implementation(experts)
        trained.append((model, torch.optim.AdamW(model.parameters(), lr=1e-4), []))
    # Runs take turns step by step, so a slow spell of this (shared, noisy) machine hits them alike.
    for step in range(2 + steps):
        for model, opt, times in trained:
            t0 = time.perf_counter()
            ce, aux = lm_loss(model, torch.from_numpy(data.batch_at(step)), cfg.model.router_aux_loss_coef)
            (ce + cfg.model.router_aux_loss_coef * aux).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
    tokens_per_step = cfg.midtrain.batch_size * cfg.data.seq_len
    for (arch, experts), (model, _, times) in zip(runs, trained):
        per_step = sorted(times[2:])[len(times[2:]) // 2]
        rows.append(
            {
                "arch": arch,
                "experts": experts or "-",
                "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
                "tokens_per_step": tokens_per_step,
                "step_s": per_step,
                "tok_s": tokens_per_step / per_step,
            }
        )
    for row in rows:  # the eager loop's time over this one's: how much faster strop's forward is
        eager = [r for r in rows if r["arch"] == row["arch"] and r["experts"] == "eager"]
        row["eager_over_this"] = eager[0]["step_s"] / row["step_s"] if eager else None
    print(f"mid-training throughput, {threads} threads, {cpu_model_name()}, median of {steps} steps")
    print(format_table(rows, ["arch", "experts", "params_m", "tokens_per_step", "step_s", "tok_s", "eager_over_this"]))
    write_json(args.json, {"threads": threads, "steps": steps, "rows": rows})
    return 0
