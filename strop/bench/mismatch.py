"""`strop bench mismatch`: how far the engine that samples is from the trainer that learns, and what
deterministic mode costs each of them.

A demo-size MoE (qwen3_moe, or `--arch deepseek_v3`; from `--checkpoint`, or randomly initialised
and mid-trained here for a few dozen steps on stdlib code so routing is not random), its weights
rounded to bf16 values as an RL engine holds them (the trainer's forward runs on the same
weights), serves multi-turn agent traffic: episodes of 4 turns sharing a system prompt, each turn's
prompt the previous prompt + completion + a tool observation, all episodes of a turn submitted
together through `--max-batch` slots at temperature 1, so prefill and decode rows mix in every
step and prompts reuse parked KV (the whole previous turn, or the shared system prompt) or miss it.
The trainer then recomputes every episode as one segment with its own code (`build_batch`,
`token_logprobs`, `router_replay`), in micro-batches of 8. Four rows:

    default                engine default, trainer plain HF forward
    replay                 same samples, trainer replays the engine's routing (R3)
    deterministic          engine deterministic, trainer under deterministic_mode
    replay+deterministic   both

Metrics are `strop.model.mismatch.mismatch_metrics` over every generated token; routing flips
compare the experts the engine recorded at every position of an episode with those the trainer's
forward chose (replay replays the generated tokens' positions, as in RL; forced tokens' positions
keep the trainer's choice). Costs are process CPU-time ratios, each the median of `--repeats`
interleaved repeats (each repeat runs every mode, in alternating order), with the range of the
repeats' ratios beside it (this machine is shared; wall time moves with other jobs): a
deterministic row against the same row without deterministic mode (replay+deterministic against
replay), the replay row against the default one. engine_cost is generating the traffic,
trainer_cost the forward + backward of the generated tokens' logprobs (a training step's work,
with replay's capture pass), forward_cost the forward alone.
"""

import argparse
import random
import statistics
import time

from strop.bench.table import format_table, write_json

TURNS = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", help="mid-trained model directory; default: mid-train a random demo model here")
    parser.add_argument(
        "--arch",
        choices=["qwen3_moe", "deepseek_v3"],
        default="qwen3_moe",
        help="architecture of the demo-size model built here (without --checkpoint)",
    )
    parser.add_argument("--quick", action="store_true", help="~1000 generated tokens, 8 mid-training steps, 2 repeats")
    parser.add_argument("--tokens", type=int, default=10_000, help="generated tokens to compare (at least)")
    parser.add_argument("--midtrain-steps", type=int, default=60, help="mid-training steps when no checkpoint is given")
    parser.add_argument("--max-batch", type=int, default=16, help="engine slots")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timing repeats per mode")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights of engine and trainer: float32 holding bf16 values (as strop's engines hold "
        "them), or bfloat16 tensors",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1, as strop runs engines and trainers; 0 = STROP_THREADS or all cores)",
    )
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


def plan_episodes(stream, target: int, quick: bool, seed: int = 0) -> list[dict]:
    """Episodes until their generated tokens reach `target`: a shared system prompt, an instruction,
    TURNS turns of random length with an observation after each but the last (windows of code)."""
    rng = random.Random(seed)

    def window(n: int) -> list[int]:
        start = rng.randrange(len(stream) - n)
        return stream[start : start + n].tolist()

    system = window(100 if quick else 200)
    lo, hi = (8, 24) if quick else (24, 64)
    episodes, total = [], 0
    while total < target:
        turns = [rng.randint(lo, hi) for _ in range(TURNS)]
        episodes.append(
            {
                "first": system + window(rng.randint(20, 60)),
                "turns": turns,
                "seed": rng.randrange(10**9),
                "observations": [window(rng.randint(30, 100)) for _ in range(TURNS - 1)],
            }
        )
        total += sum(turns)
    return episodes


def max_len(episodes: list[dict]) -> int:
    return max(len(e["first"]) + sum(e["turns"]) + sum(map(len, e["observations"])) for e in episodes) + 8


def run_episodes(engine, episodes: list[dict]) -> tuple[list, list, float]:
    """(segments as the harness records them, each episode's last completion, process CPU seconds)."""
    from strop.env.episode import Segment
    from strop.policy_api import SamplingParams, generated_routing

    segments = []
    for e in episodes:
        s = Segment()
        s.add_forced(e["first"])
        segments.append(s)
    last = [None] * len(episodes)
    t0 = time.process_time()
    for turn in range(TURNS):
        params = [
            SamplingParams(
                max_tokens=e["turns"][turn], temperature=1.0, top_p=1.0, stop_token_ids=[], seed=e["seed"] + turn
            )
            for e in episodes
        ]
        outs = engine.generate([list(s.input_ids) for s in segments], params)
        for i, (s, o, e) in enumerate(zip(segments, outs, episodes)):
            routing = generated_routing(o.routing, len(o.prompt_ids), len(o.token_ids))
            s.add_generated(o.token_ids, o.logprobs, o.versions, routing)
            last[i] = o
            if turn + 1 < TURNS:
                s.add_forced(e["observations"][turn])
    return segments, last, time.process_time() - t0


def trainer_pass(model, batches: list, replay: bool, deterministic: bool, backward: bool):
    """The trainer's logprobs of the generated tokens and the routing its forward chose, per
    micro-batch, and the process CPU seconds; with `backward` also their gradient (a step's work,
    which includes packing the step's new weights for the kernels once)."""
    from contextlib import ExitStack

    import torch

    from strop.model import kernel_ops
    from strop.model.deterministic import deterministic_mode
    from strop.model.routing import capture_routing
    from strop.rl.orchestrator import router_replay
    from strop.rl.trainer import token_logprobs

    logprobs, routing = [], []
    t0 = time.process_time()
    if backward:
        kernel_ops.forget_packs()  # a training step sees new weights
    for batch in batches:
        with ExitStack() as stack:
            if deterministic:
                stack.enter_context(deterministic_mode(model))
            if replay:
                stack.enter_context(router_replay(model, batch))
            records = stack.enter_context(capture_routing(model))
            with torch.set_grad_enabled(backward):
                lp = token_logprobs(model, batch)
                if backward:
                    lp.sum().backward()
        logprobs.append(lp.detach()[batch.mask_BT])
        routing.append(records)
    model.zero_grad(set_to_none=True)
    return logprobs, routing, time.process_time() - t0


def compare(model, batches: list, lasts: list, logprobs: list, records: list) -> dict:
    """mismatch_metrics over every generated token and every routed position."""
    import torch

    from strop.model.mismatch import mismatch_metrics
    from strop.model.routing import moe_blocks, stack_routing

    n_moe, k, E = len(moe_blocks(model)), model.config.num_experts_per_tok, moe_blocks(model)[0].gate.num_experts
    e_route, t_route = [], []
    for batch, last, rec in zip(batches, lasts, records):
        trainer = stack_routing(rec, tuple(batch.input_ids_BT.shape), E)
        for b, o in enumerate(last):
            e = torch.as_tensor(o.routing).reshape(-1, n_moe, k)
            e_route.append(e)
            t_route.append(trainer[b, : len(e)])
    behavior = torch.cat([b.behavior_BT[b.mask_BT] for b in batches])
    return mismatch_metrics(
        behavior, torch.cat(logprobs), engine_routing=torch.cat(e_route), trainer_routing=torch.cat(t_route)
    )


def _cost(times: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(median, min, max) of the ratios of interleaved (base, other) CPU times."""
    ratios = [other / base for base, other in times]
    return statistics.median(ratios), min(ratios), max(ratios)


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    threads = set_threads(args.threads or None)
    import torch

    from strop.bench.engine_inputs import setup
    from strop.config import ModelSection
    from strop.engine.engine import Engine
    from strop.errors import UserError
    from strop.model.policy import build_model
    from strop.rl.trainer import build_batch

    if args.repeats < 1 or args.tokens < 1:
        raise UserError("--repeats and --tokens must be at least 1")
    torch.manual_seed(0)
    model, tok, stream = setup(args.checkpoint)
    if not args.checkpoint and args.arch != "qwen3_moe":
        model = build_model(ModelSection(arch=args.arch), tok, seed=0).eval()
    loss = None
    if not args.checkpoint:
        loss = quick_midtrain(model, tok, 8 if args.quick else args.midtrain_steps)
    with torch.no_grad():  # the values engines hold in RL: the trainer ships bf16 snapshots
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    model = model.to(getattr(torch, args.dtype))
    episodes = plan_episodes(stream, 1000 if args.quick else args.tokens, args.quick)
    slots, repeats, length = 8 if args.quick else args.max_batch, 2 if args.quick else args.repeats, max_len(episodes)

    def engine_run(deterministic: bool):
        engine = Engine(model, tok, max_batch=slots, max_len=length, deterministic=deterministic, seed=1)
        return run_episodes(engine, episodes) + (engine.prefix_reused_tokens, engine.prefilled_tokens)

    names = {
        (False, False): "default",
        (True, False): "replay",
        (False, True): "deterministic",
        (True, True): "replay+deterministic",
    }
    samples, engine_times = {}, []
    for rep in range(repeats):  # interleaved, in alternating order: other jobs' bursts hit both modes alike
        for det in (False, True)[:: 1 if rep % 2 == 0 else -1]:
            samples[det] = engine_run(det)
        engine_times.append((samples[False][2], samples[True][2]))
    batches, lasts = {}, {}
    for det, (segments, last, *_rest) in samples.items():
        order = sorted(range(len(segments)), key=lambda i: len(segments[i]))  # as the trainer batches
        batches[det] = [
            build_batch([(segments[i], 1.0, 1.0) for i in order[at : at + 8]], tok.pad_token_id)
            for at in range(0, len(order), 8)
        ]
        lasts[det] = [[last[i] for i in order[at : at + 8]] for at in range(0, len(order), 8)]
    rows, step_times, forward_times = {}, {key: [] for key in names}, {key: [] for key in names}
    for rep in range(repeats):
        for (replay, det), name in list(names.items())[:: 1 if rep % 2 == 0 else -1]:
            lp, rec, forward_s = trainer_pass(model, batches[det], replay, det, backward=False)
            if rep == 0:
                rows[name] = {"name": name, **compare(model, batches[det], lasts[det], lp, rec)}
            forward_times[(replay, det)].append(forward_s)
            step_times[(replay, det)].append(trainer_pass(model, batches[det], replay, det, backward=True)[2])
    table = []
    for (replay, det), name in names.items():
        base = (replay, False) if det else (False, False)  # deterministic mode's cost: the same row without it
        engine = _cost(engine_times) if det else (1.0, 1.0, 1.0)
        trainer = _cost(list(zip(step_times[base], step_times[(replay, det)])))
        forward = _cost(list(zip(forward_times[base], forward_times[(replay, det)])))
        row = rows[name] | {
            "engine_cost": engine[0],
            "engine_range": f"{engine[1]:.3f}-{engine[2]:.3f}",
            "trainer_cost": trainer[0],
            "trainer_range": f"{trainer[1]:.3f}-{trainer[2]:.3f}",
            "forward_cost": forward[0],
            "forward_range": f"{forward[1]:.3f}-{forward[2]:.3f}",
        }
        table.append(row)
    reused, prefilled = samples[True][3], samples[True][4]
    cols = [
        "name",
        "tokens",
        "routing_flip_rate",
        "mean_abs_dlogp",
        "max_abs_dlogp",
        "k3",
        "bitwise_equal_frac",
        "engine_cost",
        "engine_range",
        "trainer_cost",
        "trainer_range",
        "forward_cost",
        "forward_range",
    ]
    model_desc = args.checkpoint or f"random demo-size {args.arch} mid-trained here (final loss {loss:.3f})"
    print(
        f"engine vs trainer mismatch: {model_desc}; {len(episodes)} episodes x {TURNS} turns, {slots} slots, "
        f"T=1, {args.dtype} weights holding bf16 values, {threads} threads; prefix reuse {reused} of "
        f"{reused + prefilled} prompt tokens; costs: CPU-time ratios vs the row without deterministic mode "
        f"(replay: vs default), median [range] of {repeats} interleaved repeats"
    )
    print(format_table(table, cols))
    write_json(
        args.json,
        {
            "model": model_desc,
            "arch": args.arch,
            "dtype": args.dtype,
            "threads": threads,
            "episodes": len(episodes),
            "turns": TURNS,
            "max_batch": slots,
            "repeats": repeats,
            "midtrain_loss": loss,
            "prefix_reused_tokens": reused,
            "prefilled_tokens": prefilled,
            "engine_cpu_s": engine_times,
            "trainer_step_cpu_s": {names[k]: v for k, v in step_times.items()},
            "trainer_forward_cpu_s": {names[k]: v for k, v in forward_times.items()},
            "rows": table,
        },
    )
    return 0
