"""`strop bench engine`: generation tokens/s of the strop engine vs Hugging Face `generate`.

Same model, same prompts (windows of held-out stdlib code), same sampling (temperature 1,
top-p 0.95, a fixed number of new tokens with end tokens ignored: 256, or 64 with `--quick`),
batch sizes 1, 16 and 64; both timings include prefill; HF `generate` runs with its default
KV cache. Each side reports its best of `--repeats` interleaved runs (3; 2 with `--quick`). Both run on one
torch thread unless `--threads` says otherwise: strop pins each engine to one core (the
runtimes call `set_threads(1)`), and on a shared 2-core machine a second OpenMP thread slows
both sides several-fold. Wall-clock tokens/s are the headline; ratios of process CPU time
(`cpu_*`) are reported too, since on a shared machine they are the steadier comparison. The
demo-size model comes from `--checkpoint` or is randomly initialised at the `ModelSection`
defaults (speed does not depend on the weights' values), its weights rounded to bf16 values as
an RL engine holds them (the trainer publishes bf16 snapshots; both sides compute in fp32, and the
engine streams its expert weights as bf16, which is lossless for such values). The deterministic
engine is timed as well, interleaved with the default one: `det_cost` is the median of the
repeats' CPU-time ratios (deterministic / default) with their range, the cost of deterministic
mode. Prefix reuse is off here: the repeats rerun the same prompts, which HF generate prefills
every time.

`--backend vllm` compares vLLM with strop's engine instead (`strop.bench.engine_vllm`).

`--multi-turn` times agent-style episodes instead: B concurrent episodes (1 and 16) of 4 turns,
each prompt the previous prompt + its completion + a tool observation, as the harness builds them
(a 220-token system prompt shared by all episodes, a 60-token instruction, 48 generated tokens and
a 150-token observation per turn), on engines with and without prefix reuse. Each engine is warmed
with one round of episodes first, so parked sequences (and the system prompt) are in steady state.
"""

import argparse
import statistics
import time

from strop.bench.engine_inputs import prompts_from, setup
from strop.bench.table import format_table, write_json
from strop.cpu import model_name as cpu_model_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", help="model directory; default: a random demo-size qwen3_moe")
    parser.add_argument("--quick", action="store_true", help="64 new tokens per sequence (under a minute)")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated per sequence")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for both sides (default 1, as strop runs engines; 0 = STROP_THREADS or all cores)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per batch size (2 with --quick)")
    parser.add_argument(
        "--multi-turn",
        action="store_true",
        help="time multi-turn episodes with and without prefix reuse instead of the HF comparison",
    )
    parser.add_argument(
        "--backend",
        choices=["strop", "vllm"],
        default="strop",
        help="vllm: vLLM beside strop's engine on the same model and batch, and their mismatch "
        "to the trainer with and without replay (strop.bench.engine_vllm)",
    )
    parser.add_argument("--json", help="write results to this JSON file")


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def time_hf(model, tok, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(wall, process CPU) seconds of HF generate (prompts of unequal length left-padded, masked)."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    w0, c0 = _clocks()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_p=0.95,
            top_k=0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=tok.pad_token_id,
        )
    w1, c1 = _clocks()
    assert out.shape[1] == ids.shape[1] + new_tokens
    return w1 - w0, c1 - c0


def time_engine(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(wall, process CPU) seconds of the engine generating the same."""
    from strop.policy_api import SamplingParams

    sp = SamplingParams(max_tokens=new_tokens, temperature=1.0, top_p=0.95, stop_token_ids=[])
    w0, c0 = _clocks()
    outs = engine.generate(prompts, sp)
    w1, c1 = _clocks()
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return w1 - w0, c1 - c0


def time_episodes(
    engine, firsts: list[list[int]], observations: list[list[list[int]]], new_tokens: int
) -> tuple[float, float]:
    """(wall, process CPU) seconds of len(firsts) episodes in lockstep: each turn generates for every
    episode together, then appends its completion and its next observation to its prompt."""
    from strop.policy_api import SamplingParams

    sp = SamplingParams(max_tokens=new_tokens, temperature=1.0, top_p=0.95, stop_token_ids=[])
    prompts = [list(p) for p in firsts]
    w0, c0 = _clocks()
    for obs in observations:
        outs = engine.generate(prompts, sp)
        prompts = [p + o.token_ids + x for p, o, x in zip(prompts, outs, obs)]
    outs = engine.generate(prompts, sp)
    w1, c1 = _clocks()
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return w1 - w0, c1 - c0


def run_multi_turn(args: argparse.Namespace, model, tok, stream, threads: int) -> int:
    from strop.engine.engine import Engine

    system, instruction, obs_len, turns, new_tokens = 220, 60, 150, 4, 48
    max_len = system + instruction + turns * (new_tokens + obs_len) + 8
    engines = {
        name: Engine(model, tok, max_batch=64, max_len=max_len, deterministic=det, reuse_min=reuse)
        for name, det, reuse in (
            ("engine", False, 0),
            ("engine+reuse", False, 32),
            ("deterministic", True, 0),
            ("deterministic+reuse", True, 32),
        )
    }
    head = prompts_from(stream, 1, system, 7)[0]
    rows, result = (
        [],
        {
            "threads": threads,
            "turns": turns,
            "new_tokens": new_tokens,
            "system": system,
            "instruction": instruction,
            "observation": obs_len,
            "model": args.checkpoint or "random demo-size qwen3_moe",
            "cpu": cpu_model_name(),
        },
    )
    reps = 2 if args.quick else args.repeats

    def episodes(bs: int, seed: int):
        firsts = [head + p for p in prompts_from(stream, bs, instruction, seed)]
        obs = [prompts_from(stream, bs, obs_len, seed * 100 + t) for t in range(turns - 1)]
        return firsts, obs

    for e in engines.values():  # warm up, and park a round of episodes
        time_episodes(e, *episodes(4, 99), new_tokens)
    for bs in (1, 16):
        runs = []
        for rep in range(reps):  # fresh episodes each repeat (they share only the system prompt)
            firsts, obs = episodes(bs, 1000 * bs + rep)
            runs.append({})
            for name, e in engines.items():
                reused0, prefilled0 = e.prefix_reused_tokens, e.prefilled_tokens
                runs[-1][name] = time_episodes(e, firsts, obs, new_tokens)
                runs[-1][name + ":prefill"] = (e.prefilled_tokens - prefilled0, e.prefix_reused_tokens - reused0)
        n = bs * turns * new_tokens
        best = {name: (n / min(r[name][0] for r in runs), n / min(r[name][1] for r in runs)) for name in engines}
        for mode in ("engine", "deterministic"):
            prefilled, reused = runs[-1][f"{mode}+reuse:prefill"]
            row = {
                "episodes": bs,
                "mode": mode,
                "tok_s": best[mode][0],
                "reuse_tok_s": best[f"{mode}+reuse"][0],
                "speedup": best[f"{mode}+reuse"][0] / best[mode][0],
                "cpu_speedup": best[f"{mode}+reuse"][1] / best[mode][1],
                "prefill_per_episode": runs[-1][mode + ":prefill"][0] / bs,
                "reuse_prefill_per_episode": prefilled / bs,
                "reused_per_episode": reused / bs,
            }
            rows.append(row)
            result.update({f"{mode}_{k}_eps{bs}": v for k, v in row.items() if k not in ("episodes", "mode")})
    print(
        f"multi-turn episodes, prefix reuse vs none: {result['model']}, {turns} turns of {new_tokens} tokens, "
        f"{system}-token system prompt + {instruction}-token instruction, {obs_len}-token observations, "
        f"T=1 top-p 0.95, {threads} threads, {result['cpu']}; tok_s = generated tokens/s"
    )
    print(
        format_table(
            rows,
            [
                "episodes",
                "mode",
                "tok_s",
                "reuse_tok_s",
                "speedup",
                "cpu_speedup",
                "prefill_per_episode",
                "reuse_prefill_per_episode",
                "reused_per_episode",
            ],
        )
    )
    write_json(args.json, result | {"rows": rows})
    return 0


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    threads = set_threads(args.threads or None)
    import torch

    from strop.engine.engine import Engine
    from strop.errors import UserError

    if args.repeats < 1:
        raise UserError("--repeats must be at least 1")
    if args.backend == "vllm":
        from strop.bench.engine_vllm import run_vllm

        return run_vllm(args, threads)

    torch.manual_seed(0)
    new_tokens = 64 if args.quick else args.new_tokens
    model, tok, stream = setup(args.checkpoint)
    with torch.no_grad():  # the values engines hold in RL: the trainer ships bf16 snapshots
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    if args.multi_turn:
        return run_multi_turn(args, model, tok, stream, threads)
    max_len = args.prompt_len + new_tokens + 8
    # Prefix reuse off: repeats rerun the same prompts, which HF generate has to prefill every time.
    engines = {
        "engine": Engine(model, tok, max_batch=64, max_len=max_len, reuse_min=0),
        "deterministic": Engine(model, tok, max_batch=64, max_len=max_len, deterministic=True, reuse_min=0),
    }
    warm = prompts_from(stream, 2, args.prompt_len, 99)
    time_hf(model, tok, warm, 2)
    for e in engines.values():
        time_engine(e, warm, 2)
    rows, result = (
        [],
        {
            "threads": threads,
            "new_tokens": new_tokens,
            "prompt_len": args.prompt_len,
            "model": args.checkpoint or "random demo-size qwen3_moe",
            "cpu": cpu_model_name(),
        },
    )
    reps = 2 if args.quick else args.repeats
    for bs in (1, 16, 64):
        prompts = prompts_from(stream, bs, args.prompt_len, bs)
        n = bs * new_tokens
        runs = []
        for rep in range(reps):  # engine and deterministic engine in alternating order: drift hits both alike
            hf_t = time_hf(model, tok, prompts, new_tokens)
            first, second = ("engine", "deterministic")[:: 1 if rep % 2 == 0 else -1]
            t = {first: time_engine(engines[first], prompts, new_tokens)}
            t[second] = time_engine(engines[second], prompts, new_tokens)
            runs.append((hf_t, t["engine"], t["deterministic"]))
        # Best of the interleaved repeats, per side and clock: other jobs' bursts hit both sides alike.
        (hf, hf_cpu), (eng, eng_cpu), (det, det_cpu) = (
            (n / min(r[i][0] for r in runs), n / min(r[i][1] for r in runs)) for i in range(3)
        )
        # Deterministic mode's cost: CPU-time ratios of the repeats' interleaved pairs, their median and range.
        costs = [r[2][1] / r[1][1] for r in runs]
        rows.append(
            {
                "batch": bs,
                "hf_tok_s": hf,
                "engine_tok_s": eng,
                "ratio": eng / hf,
                "cpu_ratio": eng_cpu / hf_cpu,
                "det_tok_s": det,
                "det_cost": statistics.median(costs),
                "det_range": f"{min(costs):.3f}-{max(costs):.3f}",
            }
        )
        result.update(
            {
                f"hf_tok_s_bs{bs}": hf,
                f"engine_tok_s_bs{bs}": eng,
                f"ratio_bs{bs}": eng / hf,
                f"deterministic_tok_s_bs{bs}": det,
                f"cpu_ratio_bs{bs}": eng_cpu / hf_cpu,
                f"deterministic_cost_bs{bs}": statistics.median(costs),
                f"deterministic_costs_bs{bs}": costs,
            }
        )
    print(
        f"engine vs HF generate: {result['model']}, {new_tokens} new tokens after {args.prompt_len}-token prompts, "
        f"T=1 top-p 0.95, {threads} threads, {result['cpu']}; det_cost: deterministic engine CPU time / default "
        f"engine's, median [range] of {reps} interleaved repeats"
    )
    print(
        format_table(
            rows, ["batch", "hf_tok_s", "engine_tok_s", "ratio", "cpu_ratio", "det_tok_s", "det_cost", "det_range"]
        )
    )
    write_json(args.json, result | {"rows": rows})
    return 0
