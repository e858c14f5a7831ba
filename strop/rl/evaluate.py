"""Held-out evaluation: solve rate of a policy on eval-split tasks, with a 95% Wilson interval,
overall and per difficulty.

One episode per task (greedy unless `rollout.eval_temperature` says otherwise) through the same
harness, sandbox and checker as training (the one code path). The policy runs in an in-process
engine shared by `workers` threads, so their turns decode as one batch.
"""

import math
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from tqdm import tqdm

from strop.config import Config
from strop.env.harness import Harness
from strop.env.suites import load_suite
from strop.env.task import Task
from strop.engine.policy_client import EnginePolicy
from strop.rl.rollout import WorkItem, harness_config, rollout, sandbox_limits
from strop.rl.trajectory import Trajectory

Z95 = 1.959964


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (sound at 0 and at n, unlike p +- z*se)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def eval_tasks(cfg: Config) -> list[Task]:
    r = cfg.rollout
    return [t for d in r.eval_difficulties for t in load_suite(r.suite, "eval", difficulty=d, limit=r.eval_episodes)]


def _figures(solved: list[bool]) -> dict:
    lo, hi = wilson(sum(solved), len(solved))
    return {"solve_rate": sum(solved) / max(len(solved), 1), "solve_rate_ci95": [round(lo, 4), round(hi, 4)],
            "eval_episodes": len(solved)}


def outcome(traj: Trajectory) -> str:
    """How an episode ended for the checker: solved (flagged or not), never changed the code,
    changed it but the hidden tests fail, or the checker's own failure (timeout, crash)."""
    if traj.solved:
        return "solved, hack-flagged" if traj.hack_flags else "solved"
    reason = traj.breakdown.get("reason", "")
    if reason == "no changes":
        return "no changes"
    return "tests failed" if reason.endswith("did not pass") else reason.split(":")[0]


def evaluate(cfg: Config, policy_dir: str, tasks: list[Task] | None = None, progress: bool = False) -> dict:
    """{solve_rate, solve_rate_ci95, eval_episodes, by_difficulty: {d: same}, hacked, stop_reasons,
    outcomes (see `outcome`), wall_s}."""
    from strop.engine.engine import Engine

    tasks = eval_tasks(cfg) if tasks is None else tasks
    r = cfg.rollout
    engine = Engine.from_checkpoint(policy_dir, max_batch=r.engine_batch, max_len=r.max_context, seed=cfg.run.seed)
    harness = Harness(engine.tokenizer, replace(harness_config(r), temperature=r.eval_temperature))
    limits = sandbox_limits(r)
    t0 = time.perf_counter()
    engine.start()
    try:
        with ThreadPoolExecutor(r.workers) as pool:
            items = [WorkItem(t.id, f"eval-{t.id}", 0, cfg.run.seed, engine.version) for t in tasks]
            done = pool.map(lambda ti: rollout(ti[0], EnginePolicy(engine), harness, ti[1], limits), zip(tasks, items))
            trajs = list(tqdm(done, total=len(tasks), desc=f"held-out eval {policy_dir}", unit="ep", disable=not progress))
    finally:
        engine.stop()
    by_d: dict[int, list[bool]] = {}
    for task, traj in zip(tasks, trajs):
        by_d.setdefault(int(task.metadata.get("difficulty", 0)), []).append(traj.solved and not traj.hack_flags)
    result = {**_figures([s for v in by_d.values() for s in v]),
              "by_difficulty": {str(d): _figures(v) for d, v in sorted(by_d.items())},
              "hacked": sum(bool(t.hack_flags) for t in trajs),
              "stop_reasons": dict(Counter(t.stop_reason for t in trajs).most_common()),
              "outcomes": dict(Counter(outcome(t) for t in trajs).most_common()),
              "wall_s": round(time.perf_counter() - t0, 1)}
    if progress:
        print(f"[eval] {policy_dir}: solve rate {result['solve_rate']:.3f} {result['solve_rate_ci95']} "
              f"over {result['eval_episodes']} episodes", flush=True)
    return result
