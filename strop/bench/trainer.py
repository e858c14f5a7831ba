"""`strop bench trainer`: the RL trainer sharded over N = 1, 2, 4 ranks (`trainer.parallel.fsdp`,
one torch thread each) on the same policy and the same batches, placed two ways: as local
processes (`strop.runtime.trainers.start_trainer`) and as Ray actors in a placement group on a
local Ray instance (`strop.runtime.ray.trainer.RayTrainer`, what `strop train --runtime ray` runs):
tokens/s, memory per rank, publish time per version, and how far N ranks' weights end from one
local process's. The ranks compute where `[trainer]` says (gloo on the CPU here).

The policy is the configured model (the embedded tiny MoE by default), built here and saved to a
temporary directory; each step's batch is `--rows` segments of random prompt and "generated"
tokens with advantages +-1 (throughput does not depend on what the tokens say). Per N:

- `tokens_per_s`: median over the timed steps of the trainer's own figure (every position trained on);
- `state_mib_per_rank`: the largest rank's parameters + AdamW state (its shards): falls ~1/N;
- `peak_mib_per_rank`: the largest rank's peak resident memory (the process, torch included);
- `publish_s`: median seconds per version to publish it as the trainer does: with N > 1, each rank
  encodes the delta of its own bf16 shards as a piece of the version (`strop.sync.pieces`), and
  nothing is gathered; with N = 1, the whole snapshot's delta;
- `publish_gathered_s`: the same versions published without per-shard deltas, into a second
  store: the bf16 snapshot gathered from the shards, then one delta of it encoded in rank 0's process;
- `max_abs_weight_diff_vs_single`: max |w_N - w_1| over every weight after the K steps, against
  one local process.
"""

import argparse
import statistics
import tempfile
import time

from strop.bench.table import format_table, write_json
from strop.config import add_config_arguments, config_from_args
from strop.cpu import model_name as cpu_model_name

RANK_COUNTS = (1, 2, 4)
PLACEMENTS = ("local", "ray")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per rank count (after 1 warmup step)")
    parser.add_argument("--rows", type=int, default=16, help="segments per step")
    parser.add_argument("--quick", action="store_true", help="2 timed steps of 8 segments")
    parser.add_argument("--json", help="write results to this JSON file")


def run(args: argparse.Namespace) -> int:
    import dataclasses
    from pathlib import Path

    import ray

    from strop.data.tokenizer import load_tokenizer
    from strop.model.policy import build_model, save_model
    from strop.rl.trainer import no_replay
    from strop.runtime.trainers import start_trainer, trainer_sync
    from strop.threads import set_threads

    cfg = config_from_args(args)
    set_threads(1)  # one thread per rank, so N ranks use N cores
    steps, rows = (2, 8) if args.quick else (args.steps, args.rows)
    results, single = [], None
    with tempfile.TemporaryDirectory(prefix="strop-bench-trainer-") as tmp:
        policy = Path(tmp) / "policy"
        tokenizer = demo_tokenizer(cfg, Path(tmp))
        save_model(build_model(cfg.model, tokenizer, cfg.run.seed), tokenizer, policy)
        tokenizer = load_tokenizer(policy)
        batches = synthetic_batches(len(tokenizer), rows, 1 + steps, cfg.run.seed)
        for placement, n in [(p, n) for p in PLACEMENTS for n in RANK_COUNTS]:
            run_cfg = dataclasses.replace(
                cfg,
                trainer=dataclasses.replace(cfg.trainer, parallel=dataclasses.replace(cfg.trainer.parallel, fsdp=n)),
            )
            store = str(Path(tmp) / f"store-{placement}{n}")
            if placement == "local":
                trainer = start_trainer(run_cfg, str(policy), no_replay, tokenizer.pad_token_id, store)
            else:
                trainer = ray_trainer(run_cfg, str(policy), tokenizer.pad_token_id, store)
            gathered = trainer_sync(run_cfg, str(Path(tmp) / f"gathered-{placement}{n}"))
            try:
                trainer.publish()
                gathered.publish(trainer.version, trainer.bf16_state_dict())
                step_rows, gathered_s = [], []
                for b in batches:
                    step_rows.append(trainer.step(b))
                    t0 = time.perf_counter()
                    gathered.publish(trainer.version, trainer.bf16_state_dict())
                    gathered_s.append(time.perf_counter() - t0)
                step_rows, gathered_s = step_rows[1:], gathered_s[1:]  # the first step pays one-off costs
                memory = trainer.memory()
                weights = trainer.state_dict()["model"]
            finally:
                gathered.close()
                trainer.close()
            single = single or weights
            results.append(
                {
                    "placement": placement,
                    "ranks": n,
                    "device": memory[0]["device"],
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in step_rows),
                    "state_mib_per_rank": max(m["state_mib"] for m in memory),
                    "peak_mib_per_rank": max(m["peak_rss_mib"] for m in memory),
                    "publish_s": statistics.median(r["publish_s"] for r in step_rows),
                    "publish_gathered_s": statistics.median(gathered_s),
                    "max_abs_weight_diff_vs_single": max(float((weights[k] - single[k]).abs().max()) for k in single),
                }
            )
    ray.shutdown()  # a no-op unless the Ray rows started it
    print(
        "RL trainer sharded over N ranks (FSDP2, gloo, 1 thread each), local processes and Ray actors, "
        f"{cpu_model_name()}, "
        f"{rows} segments a step, median of {steps} steps after 1 warmup"
    )
    print(
        format_table(
            results,
            [
                "placement",
                "ranks",
                "device",
                "tokens_per_s",
                "state_mib_per_rank",
                "peak_mib_per_rank",
                "publish_s",
                "publish_gathered_s",
                "max_abs_weight_diff_vs_single",
            ],
        )
    )
    write_json(
        args.json,
        {
            "steps": steps,
            "rows": rows,
            "model": dataclasses.asdict(cfg.model),
            "ranks": {str(r["ranks"]): r for r in results if r["placement"] == "local"},
            "ray": {str(r["ranks"]): r for r in results if r["placement"] == "ray"},
            "max_abs_weight_diff_vs_single": max(r["max_abs_weight_diff_vs_single"] for r in results),
        },
    )
    return 0


def ray_trainer(cfg, policy: str, pad_id: int, store: str):
    """The trainer's ranks as Ray actors on a local Ray instance (started here once: 2 CPUs, no dashboard)."""
    import ray

    from strop.rl.trainer import no_replay
    from strop.runtime.ray.trainer import RayTrainer

    if not ray.is_initialized():
        # "local": a new instance, even where `ray start` left a cluster running on this machine
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    return RayTrainer(cfg, policy, no_replay, pad_id, store)


def demo_tokenizer(cfg, tmp):
    """A tokenizer trained on a slice of the configured corpus (the policy's vocabulary)."""
    from strop.data.corpus import load_corpus
    from strop.data.tokenizer import train_tokenizer

    return train_tokenizer(load_corpus(cfg.data).train[:200], cfg.data.vocab_size, 400_000)


def synthetic_batches(vocab: int, rows: int, steps: int, seed: int) -> list[list]:
    """`steps` batches of `rows` one-segment samples: a 48-token prompt, 16 "generated" tokens of
    behaviour logprob log(1/vocab), advantage +-1, weights summing to 1 over a batch."""
    import math
    import random

    from strop.env.episode import Segment
    from strop.rl.advantages import Sample
    from strop.rl.trajectory import Trajectory

    rng = random.Random(seed)
    batches = []
    for step in range(steps):
        batch = []
        for r in range(rows):
            seg = Segment()
            seg.add_forced([rng.randrange(vocab) for _ in range(48)])
            seg.add_generated([rng.randrange(vocab) for _ in range(16)], [-math.log(vocab)] * 16, [step] * 16, None)
            traj = Trajectory("bench", f"s{step}", r, [seg], float(r % 2), start_version=step)
            batch.append(Sample(traj, 1.0 if r % 2 else -1.0, 1 / (16 * rows), traj.reward))
        batches.append(batch)
    return batches
