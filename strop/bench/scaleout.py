"""`strop bench scaleout [--quick] --json F`: weight sync on a multi-node Ray cluster started on
this machine (`strop.runtime.ray.local_cluster`): a trainer node and two inference clusters ("a" with
two engines, "b" with one), each behind its relay, every trainer-to-cluster link shaped by a token
bucket to `--wan-mb-s` (standing for WAN bandwidth). The same short RL job runs twice, with
`sync.type = "delta"` and `"full"`; in each, after step 1 an engine joins cluster b (harvested
capacity: it bootstraps from the store and takes work) and after step 2 one of cluster a's engines
is killed with work in flight (relaunched elsewhere).

Reported per version (delta run): the trainer's egress (deltas and bytes its origin sent: ideally
one copy per inference cluster), the time until every engine serving at that point held it
verified, and every engine's swap pause; per run, end-to-end steps/hour. JSON keys:
`egress_deltas_per_cluster_version` (mean over versions after the first), `swap_pause_ms_p50`
(+ `_max`), `steps_per_hour_delta`, `steps_per_hour_full`, `delta_vs_full_steps_per_hour`,
`engines_joined`, `engines_lost`, `trajectories_lost`, `trained_twice`, and `versions` (the per
version table) and `runs`.

The default `sync` mode puts each version's transfer on the critical path (generate, train, sync),
so the transport's cost shows in steps/hour; `--mode async` hides it behind generation until the
links saturate. The policy is a random demo-size Qwen3-MoE (7.0M parameters, built here and
cached), whose swap pause is the one the acceptance bar speaks of. It earns no reward, so its
gradients are zero: weight decay (`rl.lr` 1e-3 x `rl.weight_decay` 1.0 = a 1e-3 relative step)
changes ~18% of its bf16 values per version, about the demo's RL (20%); deltas of uniform decay
compress somewhat better than real updates, so the delta/full byte ratio is in the JSON to judge.
`--policy DIR` measures a trained policy instead (its own rewards and gradients).
"""

import argparse
import os
import statistics
import time
from pathlib import Path

CLUSTERS = ["a", "b"]
BENCH = [
    "rl.group_size=2",
    "rl.batch_groups=2",
    "rl.max_staleness=1",
    "rl.lr=1e-3",
    "rl.weight_decay=1.0",
    "rl.skip_zero_advantage=false",
    "rollout.engines=3",
    "rollout.workers=4",
    "rollout.engine_batch=8",
    "rollout.max_turns=2",
    "rollout.max_turn_tokens=32",
    "rollout.max_context=1536",
    "rollout.train_tasks=16",
    "rollout.ckpt_every=1000",
    "rollout.retries=3",
    "sync.keep_deltas=4",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from strop.config import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="4 steps per run (a smoke test, ~3 minutes)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default 8, quick 4; at least 3)")
    parser.add_argument("--mode", choices=["sync", "async"], default="sync", help="RL mode of both runs")
    parser.add_argument("--wan-mb-s", type=float, default=10.0, help="bandwidth of each trainer-to-cluster link, MB/s")
    parser.add_argument("--policy", help="model directory to train (default: a random demo-size MoE, cached in --out)")
    parser.add_argument("--out", default="runs/bench-scaleout", help="working directory")
    parser.add_argument("--json", help="write results to this JSON file")


def demo_size_policy(out: Path) -> Path:
    """The demo's model shape (`ModelSection` defaults), randomly initialised, built once."""
    from strop.config import ModelSection
    from strop.env.demonstrators.runs import default_tokenizer
    from strop.model.policy import build_model, is_model_dir, save_model

    path = out / "policy-demo-size"
    if not is_model_dir(path):
        tok = default_tokenizer()
        save_model(build_model(ModelSection(), tok, seed=0), tok, path)
    return path


def run_once(cfg, policy: Path, mode: str, out: Path, address: str) -> dict:
    """One RL run on the local cluster, with an engine joining and one killed; its figures."""
    import ray

    from strop.rl.orchestrator import Orchestrator, router_replay
    from strop.runtime import record_trained
    from strop.runtime.ray.actors import start_ray
    from strop.runtime.rl_run import train_tasks

    tasks = {t.id: t for t in train_tasks(cfg)}
    store = str(out / "weights")
    rt = start_ray(cfg, str(policy), tasks, router_replay, address=address, store_url=store)
    trained = record_trained(rt)
    joined_at: dict[str, float] = {name: 0.0 for name in rt.engines}
    lost: list[str] = []

    def churn(row):
        if row["step"] == 1:
            name = rt.add_engine("b")
            joined_at[name] = time.time()
        if row["step"] == 2:
            lost.append(next(n for n, c in sorted(rt.engine_cluster.items()) if c == "a"))
            ray.kill(rt.engines[lost[-1]])

    try:
        orch = Orchestrator(cfg, rt, list(tasks), mode, out / "rl", log=churn)
        result = orch.run()
        rt.wait_synced()
        stats = rt.sync_stats()
        infos = {name: ray.get(e.info.remote()) for name, e in rt.engines.items()}
    finally:
        rt.close()
    versions = []
    for v in range(1, result["steps"] + 1):
        serving = [i for name, i in infos.items() if joined_at[name] < stats["published_at"][v]]
        held = [at for i in serving for w, _, at in i["swaps"] if w == v]
        n, nbytes = stats["sent_by_version"].get(v, [0, 0])
        versions.append(
            {
                "version": v,
                "file_bytes": stats["file_bytes"][v],
                "egress_deltas": n,
                "egress_bytes": nbytes,
                "time_to_all_engines_s": round(max(held) - stats["published_at"][v], 3)
                if len(held) == len(serving)
                else None,
            }
        )
    pauses = [p for i in infos.values() for _, p, _ in i["swaps"][1:]]  # [0] is each engine's bootstrap
    return {
        "type": cfg.sync.type,
        "steps": result["steps"],
        "wall_s": round(result["wall_s"], 1),
        "steps_per_hour": round(result["steps"] * 3600 / result["wall_s"], 1),
        "versions": versions,
        "swap_pauses_ms": [round(1e3 * p, 2) for p in pauses],
        "engines_joined": len(joined_at) - cfg.rollout.engines,
        "engines_lost": len(lost),
        "trajectories_lost": result.get("lost", 0),
        "relaunched": result.get("relaunched", 0),
        "trained_twice": len(trained) - len(set(trained)),
        "bytes_sent": stats["bytes_sent"],
        "repaired_bytes": sum(i["repaired_bytes"] for i in infos.values()),
        "engines": {name: {"cluster": i["label"], "swaps": len(i["swaps"])} for name, i in infos.items()},
    }


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    set_threads(1)
    from strop.bench.table import format_table, write_json
    from strop.config import load_config
    from strop.errors import UserError
    from strop.outputs import claim_dir
    from strop.runtime.ray.local_cluster import local_cluster

    steps = args.steps if args.steps is not None else (4 if args.quick else 8)
    if steps < 3:
        raise UserError(
            "bench scaleout: --steps must be at least 3 (an engine joins after step 1, one dies after step 2)"
        )
    if args.wan_mb_s <= 0:
        raise UserError("bench scaleout: --wan-mb-s must be > 0")
    out = claim_dir(Path(args.out), "bench scaleout")  # it writes its runs' stores and metrics in there
    policy = Path(args.policy) if args.policy else demo_size_policy(out)
    t0 = time.perf_counter()
    runs = {}
    with local_cluster(CLUSTERS) as address:
        for kind in ("delta", "full"):
            cfg = load_config(
                args.config,
                BENCH + [f"rl.steps={steps}", f"sync.type={kind}", f"sync.wan_mb_s={args.wan_mb_s}"] + args.overrides,
            )
            runs[kind] = run_once(cfg, policy, args.mode, out / kind, address)
            print(
                f"[bench scaleout] {kind}: {runs[kind]['steps']} steps in {runs[kind]['wall_s']} s "
                f"({runs[kind]['steps_per_hour']} steps/h)",
                flush=True,
            )
    delta, full = runs["delta"], runs["full"]
    later = [v for v in delta["versions"] if v["version"] > 1]
    per_cluster = statistics.mean(v["egress_deltas"] / len(CLUSTERS) for v in later)
    pauses = delta["swap_pauses_ms"]
    full_bytes = statistics.mean(v["egress_bytes"] for v in full["versions"]) / len(CLUSTERS)
    delta_bytes = statistics.mean(v["egress_bytes"] for v in later) / len(CLUSTERS)
    summary = {
        "egress_deltas_per_cluster_version": round(per_cluster, 3),
        "swap_pause_ms_p50": round(statistics.median(pauses), 2),
        "swap_pause_ms_max": round(max(pauses), 2),
        "steps_per_hour_delta": delta["steps_per_hour"],
        "steps_per_hour_full": full["steps_per_hour"],
        "delta_vs_full_steps_per_hour": round(delta["steps_per_hour"] / full["steps_per_hour"], 3),
        "delta_vs_full_bytes_per_version": round(delta_bytes / full_bytes, 4),
        "engines_joined": delta["engines_joined"] + full["engines_joined"],
        "engines_lost": delta["engines_lost"] + full["engines_lost"],
        "trajectories_lost": delta["trajectories_lost"] + full["trajectories_lost"],
        "trained_twice": delta["trained_twice"] + full["trained_twice"],
    }
    print(
        f"delta run, per version ({len(CLUSTERS)} inference clusters, {args.wan_mb_s:g} MB/s trainer-to-cluster links, "
        f"{args.mode} mode, policy {policy}):"
    )
    print(
        format_table(
            delta["versions"], ["version", "file_bytes", "egress_deltas", "egress_bytes", "time_to_all_engines_s"]
        )
    )
    print(
        format_table(
            [
                {
                    "type": k,
                    **{
                        f: r[f]
                        for f in (
                            "steps",
                            "wall_s",
                            "steps_per_hour",
                            "bytes_sent",
                            "engines_joined",
                            "engines_lost",
                            "trajectories_lost",
                            "relaunched",
                        )
                    },
                }
                for k, r in runs.items()
            ],
            [
                "type",
                "steps",
                "wall_s",
                "steps_per_hour",
                "bytes_sent",
                "engines_joined",
                "engines_lost",
                "trajectories_lost",
                "relaunched",
            ],
        )
    )
    print(
        f"trainer egress {summary['egress_deltas_per_cluster_version']:.2f} deltas per cluster per version; "
        "swap pause p50 "
        f"{summary['swap_pause_ms_p50']:.1f} ms (max {summary['swap_pause_ms_max']:.1f}); steps/hour delta / full "
        f"{summary['delta_vs_full_steps_per_hour']:.2f}x; a delta is {summary['delta_vs_full_bytes_per_version']:.3f} "
        f"of a full version on the wire ({time.perf_counter() - t0:.0f} s, load average {os.getloadavg()[0]:.1f})"
    )
    write_json(
        args.json,
        {
            **summary,
            "versions": delta["versions"],
            "runs": runs,
            "mode": args.mode,
            "steps": steps,
            "wan_mb_s": args.wan_mb_s,
            "clusters": CLUSTERS,
            "policy": str(policy),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "seconds": round(time.perf_counter() - t0, 1),
        },
    )
    return 0
