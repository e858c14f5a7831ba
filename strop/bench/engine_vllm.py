"""`strop bench engine --backend vllm`: vLLM beside strop's engine on the same model, prompts and
batch, and how far each is from the trainer.

The model (`--checkpoint`, or the random demo-size qwen3_moe of `strop bench engine`, its weights
rounded to bf16 values as an RL engine holds them) is saved in HF format and served by vLLM in a
child process, started as an RL run starts it (`strop.engine.vllm_server`: fp32 compute, routed
experts returned, processed logprobs, eager mode); strop's engine runs in this process on
`--threads` threads (1 by default). Both generate `new_tokens` (64 with `--quick`) for 16 prompts at
once (T=1, top-p 0.95, end tokens ignored), best of `--repeats` interleaved runs (2 with
`--quick`), through the same `PolicyClient` an RL run uses; vLLM's 16 requests go concurrently
over HTTP so its scheduler batches them (that HTTP and JSON cost is part of its figure, as in a
run). vLLM's start-up (load, warm-up) is timed on its own, outside tokens/s.

Mismatch: 16 more completions from each engine at T=1, top-p 1 (so processed logprobs are the
model's), recomputed by the trainer's plain forward on the same weights without and with
replaying the engine's routing (`strop.model.mismatch.engine_vs_trainer`, as the RL trainer
measures): routing flips, mean |Δlogp| and k3.
"""

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from strop.bench.table import format_table, write_json
from strop.cpu import model_name as cpu_model_name

BATCH = 16


def generate_all(policy, prompts: list[list[int]], params) -> tuple[float, list]:
    """(wall seconds, Generations) of every prompt sent at once from its own thread."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        gens = list(pool.map(lambda p: policy.generate(p, params), prompts))
    return time.perf_counter() - t0, gens


def run_vllm(args: argparse.Namespace, threads: int) -> int:
    import torch

    from strop.bench.engine_inputs import prompts_from, setup
    from strop.engine.endpoint import EndpointClient
    from strop.engine.engine import Engine
    from strop.engine.policy_client import EnginePolicy
    from strop.engine.server_process import ServerProcess
    from strop.engine.vllm_server import installed, returns_routed_experts, vllm_argv, vllm_env
    from strop.errors import UserError
    from strop.model.mismatch import engine_vs_trainer
    from strop.model.policy import save_model
    from strop.policy_api import SamplingParams

    if not installed():
        raise UserError("--backend vllm needs vLLM, which is not installed here: run `make vllm`")
    torch.manual_seed(0)
    new_tokens = 64 if args.quick else args.new_tokens
    reps = 2 if args.quick else args.repeats
    model, tok, stream = setup(args.checkpoint)
    with torch.no_grad():  # the values engines hold in RL: the trainer ships bf16 snapshots
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    max_len = args.prompt_len + new_tokens + 8
    timed = SamplingParams(max_tokens=new_tokens, temperature=1.0, top_p=0.95, stop_token_ids=[])
    sampled = SamplingParams(max_tokens=new_tokens, temperature=1.0, top_p=1.0, stop_token_ids=[])
    prompts = prompts_from(stream, BATCH, args.prompt_len, BATCH)
    probe_prompts = prompts_from(stream, BATCH, args.prompt_len, 7)
    engine = Engine(model, tok, max_batch=64, max_len=max_len, reuse_min=0)
    policies = {"engine": EnginePolicy(engine)}
    with tempfile.TemporaryDirectory(prefix="strop-bench-vllm-") as tmp:
        save_model(model, tok, tmp)
        t0 = time.perf_counter()
        routed = returns_routed_experts()
        server = ServerProcess(
            vllm_argv(tmp, name="strop", max_len=max_len, max_batch=BATCH, seed=0, routed_experts=routed),
            env=vllm_env(threads, routed),
        )
        try:
            policies["vllm"] = EndpointClient(server.url, model="strop")
            generate_all(policies["vllm"], prompts[:2], SamplingParams(max_tokens=2, stop_token_ids=[]))
            startup_s = time.perf_counter() - t0  # load + first (compiling) batch
            generate_all(policies["engine"], prompts[:2], SamplingParams(max_tokens=2, stop_token_ids=[]))
            best = {name: 0.0 for name in policies}
            for rep in range(reps):  # alternating order: drift hits both alike
                for name in ("vllm", "engine") if rep % 2 == 0 else ("engine", "vllm"):
                    wall, gens = generate_all(policies[name], prompts, timed)
                    best[name] = max(best[name], sum(len(g.token_ids) for g in gens) / wall)
            mismatch = {
                name: engine_vs_trainer(model, list(zip(probe_prompts, generate_all(p, probe_prompts, sampled)[1])))
                for name, p in policies.items()
            }
        finally:
            server.close()
    faster = "vllm" if best["vllm"] > best["engine"] else "strop's engine"
    result = {
        "threads": threads,
        "new_tokens": new_tokens,
        "prompt_len": args.prompt_len,
        "batch": BATCH,
        "model": args.checkpoint or "random demo-size qwen3_moe",
        "cpu": cpu_model_name(),
        "vllm_tok_s_bs16": best["vllm"],
        "engine_tok_s_bs16": best["engine"],
        "vllm_over_engine": best["vllm"] / best["engine"],
        "faster": faster,
        "vllm_startup_s": startup_s,
    }
    rows = []
    for name, m in mismatch.items():
        for mode in ("plain", "replay"):
            rows.append(
                {
                    "engine": name,
                    "trainer": mode,
                    "flips": m[mode].get("routing_flip_rate"),  # None: the engine returned no routing
                    "mean_abs_dlogp": m[mode]["mean_abs_dlogp"],
                    "max_abs_dlogp": m[mode]["max_abs_dlogp"],
                    "k3": m[mode]["k3"],
                    "tokens": m[mode]["tokens"],
                }
            )
        prefix = "vllm" if name == "vllm" else "engine"
        result[f"{prefix}_flips_without_replay"] = m["plain"].get("routing_flip_rate")  # None: no routing returned
        result[f"{prefix}_replay_flips"] = m["replay"].get("routing_flip_rate")
        for k in ("mean_abs_dlogp", "k3"):
            result[f"{prefix}_{k}"] = m["plain"][k]
            result[f"{prefix}_{k}_replay"] = m["replay"][k]
    print(
        f"vLLM vs strop's engine: {result['model']}, batch {BATCH}, {new_tokens} new tokens after "
        f"{args.prompt_len}-token prompts, T=1 top-p 0.95, best of {reps}; strop's engine on {threads} threads, "
        f"{result['cpu']}; vLLM start-up {startup_s:.0f} s (not in tok/s)"
    )
    print(
        format_table(
            [{"engine": "vllm", "tok_s_bs16": best["vllm"]}, {"engine": "strop", "tok_s_bs16": best["engine"]}],
            ["engine", "tok_s_bs16"],
        )
    )
    print(f"faster here: {faster} ({max(best.values()) / min(best.values()):.2f}x)")
    print("mismatch to the trainer (plain HF forward on the same weights), T=1 top-p 1:")
    print(format_table(rows, ["engine", "trainer", "flips", "mean_abs_dlogp", "max_abs_dlogp", "k3", "tokens"]))
    write_json(args.json, result | {"rows": rows})
    return 0
