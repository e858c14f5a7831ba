"""`strop bench mismatch`: how far the engine that samples is from the trainer that learns.

The demo-size qwen3_moe (from `--checkpoint`, or randomly initialised and mid-trained here for a
few dozen steps of next-token loss on stdlib code so routing is not random) samples responses
to held-out code prompts at temperature 1 in the serving dtype (bf16 by default: strop ships
bf16 weights to engines; the trainer's forward runs on the same bf16 weights), with continuous
batching (more requests than slots, shuffled, random prompt and response lengths: prefill and
decode rows mix in every step). The trainer then recomputes every response token with a
full-sequence forward. Four rows:

    default                engine default ops, trainer plain HF forward
    replay                 same samples, trainer replays the engine's routing (R3)
    deterministic          engine batch-invariant ops, trainer under deterministic_mode
    replay+deterministic   both

Metrics are `strop.model.mismatch.mismatch_metrics` over all response tokens; routing flips
compare the engine's recorded experts with those the trainer's forward chose, over every
position. `slowdown` is engine + trainer process CPU time against the default row (`engine_slowdown`
and `trainer_slowdown` split it).
"""

import argparse
import random
import time

from strop.bench.table import format_table, write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", help="mid-trained model directory; default: mid-train a random demo model here")
    parser.add_argument("--quick", action="store_true", help="~800 response tokens, 8 mid-training steps (under a minute)")
    parser.add_argument("--tokens", type=int, default=10_000, help="response tokens to compare (at least)")
    parser.add_argument("--midtrain-steps", type=int, default=60, help="mid-training steps when no checkpoint is given")
    parser.add_argument("--max-batch", type=int, default=16, help="engine slots")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="serving dtype of engine and trainer (strop ships bf16 weights to engines)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1, as strop runs engines and trainers; 0 = STROP_THREADS or all cores)")
    parser.add_argument("--json", help="write results to this JSON file")


def quick_midtrain(model, tokenizer, steps: int, seed: int = 0) -> float:
    """A few AdamW steps of next-token loss on packed stdlib code; returns the last loss."""
    import torch

    from strop.config import DataSection
    from strop.data.corpus import load_corpus
    from strop.data.packing import PackedBatches, tokenize_documents
    from strop.train.midtrain import lm_loss

    corpus = load_corpus(DataSection())
    data = PackedBatches(tokenize_documents(tokenizer, corpus.train[:120]), 128, 8, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    loss = float("nan")
    for step in range(steps):
        ce, aux = lm_loss(model, torch.from_numpy(data.batch_at(step)), 0.01)
        (ce + 0.01 * aux).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(ce.detach())
    model.eval()
    return loss


def sample(model, tokenizer, prompts, lengths, max_batch: int, deterministic: bool, seed: int):
    """Engine outputs and the process CPU seconds they took (steadier than wall time on a shared machine)."""
    from strop.engine.engine import Engine, SamplingParams

    engine = Engine(model, tokenizer, max_batch=max_batch, max_len=512, deterministic=deterministic, seed=seed)
    params = [SamplingParams(max_tokens=n, temperature=1.0, top_p=1.0, stop_token_ids=[]) for n in lengths]
    t0 = time.process_time()
    outs = engine.generate(prompts, params)
    return outs, time.process_time() - t0


def compare(model, outs, replay: bool, deterministic: bool) -> tuple[dict, float]:
    import numpy as np
    import torch

    from strop.model.mismatch import mismatch_metrics, recompute

    e_lp, t_lp, e_route, t_route = [], [], [], []
    t0 = time.process_time()
    for o in outs:
        lp, routing = recompute(model, o.prompt_ids, o.token_ids, routing=o.routing if replay else None,
                                deterministic=deterministic)
        e_lp.append(torch.tensor(o.logprobs))
        t_lp.append(lp)
        e_route.append(o.routing)
        t_route.append(routing.numpy())
    dt = time.process_time() - t0
    m = mismatch_metrics(torch.cat(e_lp), torch.cat(t_lp), engine_routing=np.concatenate(e_route),
                         trainer_routing=np.concatenate(t_route))
    return m, dt


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    threads = set_threads(args.threads or None)
    import torch

    from strop.bench.engine import setup

    torch.manual_seed(0)
    rng = random.Random(0)
    model, tok, stream = setup(args.checkpoint)
    loss = None
    if not args.checkpoint:
        loss = quick_midtrain(model, tok, 8 if args.quick else args.midtrain_steps)
    model = model.to(getattr(torch, args.dtype))
    target = 800 if args.quick else args.tokens
    lo, hi = (16, 48) if args.quick else (48, 160)
    prompts, lengths = [], []
    while sum(lengths) < target:
        n = rng.randint(16, 64)
        start = rng.randrange(len(stream) - n)
        prompts.append(stream[start : start + n].tolist())
        lengths.append(rng.randint(lo, hi))
    max_batch = 8 if args.quick else args.max_batch
    rows, times = [], {}
    for det_mode in (False, True):
        outs, gen_s = sample(model, tok, prompts, lengths, max_batch, det_mode, seed=1)
        for replay in (False, True):
            name = "+".join(["replay"] * replay + ["deterministic"] * det_mode) or "default"
            m, train_s = compare(model, outs, replay, det_mode)
            times[name] = (gen_s, train_s)
            rows.append({"name": name, **m})
    base_gen, base_train = times["default"]
    for r in rows:
        gen_s, train_s = times[r["name"]]
        r.update(engine_s=gen_s, trainer_s=train_s, engine_slowdown=gen_s / base_gen,
                 trainer_slowdown=train_s / base_train, slowdown=(gen_s + train_s) / (base_gen + base_train))
    cols = ["name", "tokens", "routing_flip_rate", "mean_abs_dlogp", "max_abs_dlogp", "k3", "ratio_outside_frac",
            "bitwise_equal_frac", "engine_slowdown", "trainer_slowdown", "slowdown"]
    model_desc = args.checkpoint or f"random demo-size qwen3_moe mid-trained here (final loss {loss:.3f})"
    print(f"engine vs trainer mismatch: {model_desc}; {len(prompts)} requests, {max_batch} slots, "
          f"T=1, {args.dtype}, {threads} threads")
    print(format_table(rows, cols))
    write_json(args.json, {"model": model_desc, "dtype": args.dtype, "threads": threads, "requests": len(prompts),
                           "max_batch": max_batch, "midtrain_loss": loss, "rows": rows})
    return 0
