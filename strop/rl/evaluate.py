"""Held-out evaluation: solve rate of a policy on eval-split tasks, with a 95% Wilson interval,
overall and per difficulty, and what the agent did (`strop.env.grading.behaviour`).

One episode per task (greedy unless `rollout.eval_temperature` says otherwise) through the same
harness, sandbox and checker as training (the one code path). With `samples=K`, every task is also
sampled K times at the rollout temperature, for pass@1 and pass@K: how much better the policy
does sometimes than it does reliably — the headroom RL can turn into pass@1. The policy runs in
`rollout.engines` in-process engines (one core each: the kernels are single-threaded and release
the GIL), episodes dealt round robin to `workers` threads; the turns on one engine decode as one batch.
A row's numbers do not depend on its batch, so the engine count changes the wall time only.
"""

import math
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from tqdm import tqdm

from strop.config import Config
from strop.engine.policy_client import EnginePolicy
from strop.env.grading.behaviour import summarize
from strop.env.harness.context import context_figures
from strop.env.harness.loop import Harness, harness_config
from strop.env.task import Task
from strop.env.tasks.suites import draw_tasks, selection_note, with_default_image
from strop.errors import UserError
from strop.gc_freeze import freeze_long_lived
from strop.rl.rollout import WorkItem, rollout, sandbox_limits
from strop.rl.rollout_log import RolloutLog, record
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


def paired_change(before: dict[str, bool], after: dict[str, bool]) -> dict:
    """How the solve outcomes of the same tasks changed between two policies: tasks solved only
    after (`gained`), only before (`lost`), and the exact two-sided McNemar p-value of that split
    (a binomial test on the tasks that changed). Pairing by task removes the spread between tasks
    that makes two separate Wilson intervals overlap; a p below 0.05 says the change is not churn."""
    common = before.keys() & after.keys()
    gained = sum(after[t] and not before[t] for t in common)
    lost = sum(before[t] and not after[t] for t in common)
    n, k = gained + lost, min(gained, lost)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0
    return {"tasks": len(common), "gained": gained, "lost": lost, "mcnemar_p": round(p, 4)}


def eval_tasks(cfg: Config) -> list[Task]:
    """`rollout.eval_episodes` held-out tasks of `rollout.suite` per evaluated difficulty."""
    r = cfg.rollout
    tasks = draw_tasks(r.suite, "eval", r.eval_difficulties, r.eval_episodes)
    note = selection_note(r.suite, "eval", r.eval_difficulties, "rollout.eval_difficulties", len(tasks))
    if note and not tasks:
        raise UserError(note)
    if note:
        print(f"[eval] warning: {note}", file=sys.stderr, flush=True)
    if not tasks:
        raise UserError(f"no eval tasks in suite {r.suite!r} for rollout.eval_difficulties = {r.eval_difficulties}")
    return with_default_image(tasks, r.image)


def rate_figures(solved: list[bool]) -> dict:
    """Solve rate, its 95% Wilson interval and the episode count of `solved` outcomes."""
    lo, hi = wilson(sum(solved), len(solved))
    return {
        "solve_rate": sum(solved) / max(len(solved), 1),
        "solve_rate_ci95": [round(lo, 4), round(hi, 4)],
        "eval_episodes": len(solved),
    }


def counts_as_solved(traj: Trajectory) -> bool:
    """Solved, and not by gaming the reward (see `Trajectory.hacked`)."""
    return traj.solved and not traj.hacked


def outcome(traj: Trajectory) -> str:
    """How an episode ended for the checker: solved (flagged or not), never changed the code,
    changed it but the hidden tests fail, or the checker's own failure (timeout, crash)."""
    if traj.solved:
        return "solved, hack-flagged" if traj.hacked else "solved"
    if traj.breakdown.get("outcome") in ("no changes", "tests failed"):
        return traj.breakdown["outcome"]
    return traj.breakdown.get("reason", "").split(":")[0]  # not scored: why, without the detail


def _mean_interval(rates: list[float], z: float = Z95) -> tuple[float, float]:
    """A normal interval for the mean of per-task rates (tasks are the independent units)."""
    n = len(rates)
    if n < 2:
        return 0.0, 1.0
    mean = sum(rates) / n
    sd = math.sqrt(sum((r - mean) ** 2 for r in rates) / (n - 1))
    return max(0.0, mean - z * sd / math.sqrt(n)), min(1.0, mean + z * sd / math.sqrt(n))


def reward_figures(rewards: list[float]) -> dict:
    """Mean checker reward of held-out episodes and its 95% interval: on a suite with partial credit
    (`chain`: the share of hidden checks passed) it moves before the solve rate does."""
    lo, hi = _mean_interval(rewards)
    return {
        "reward_mean": round(sum(rewards) / max(len(rewards), 1), 4),
        "reward_ci95": [round(lo, 4), round(hi, 4)],
    }


def held_out_reward(traj: Trajectory) -> float:
    """The checker's reward, 0 for a hack-flagged episode (as `counts_as_solved` does for solves)."""
    return 0.0 if traj.hacked else traj.reward


def _pass_figures(per_task: list[list[bool]]) -> dict:
    """pass@1 (mean per-task success rate over its K samples) and pass@K (share of tasks solved at
    least once), each with a 95% interval."""
    rates = [sum(s) / len(s) for s in per_task]
    lo1, hi1 = _mean_interval(rates)
    any_ = [any(s) for s in per_task]
    lok, hik = wilson(sum(any_), len(any_))
    return {
        "pass@1": round(sum(rates) / max(len(rates), 1), 4),
        "pass@1_ci95": [round(lo1, 4), round(hi1, 4)],
        "pass@k": round(sum(any_) / max(len(any_), 1), 4),
        "pass@k_ci95": [round(lok, 4), round(hik, 4)],
        "tasks": len(per_task),
    }


def _run(
    engines: list,
    episodes: list[tuple[Harness, Task, WorkItem]],
    limits,
    workers: int,
    desc: str,
    progress: bool,
) -> list[Trajectory]:
    policies = [EnginePolicy(e) for e in engines]
    with ThreadPoolExecutor(workers) as pool:
        done = pool.map(
            lambda i: rollout(episodes[i][1], policies[i % len(policies)], episodes[i][0], episodes[i][2], limits),
            range(len(episodes)),
        )
        return list(tqdm(done, total=len(episodes), desc=desc, unit="ep", disable=not progress))


def evaluate(
    cfg: Config,
    policy_dir: str,
    tasks: list[Task] | None = None,
    progress: bool = False,
    samples: int = 0,
    rollouts: RolloutLog | None = None,
) -> dict:
    """{solve_rate, solve_rate_ci95, eval_episodes, reward_mean, reward_ci95 (`reward_figures`),
    by_difficulty: {d: solve figures}, hacked, stop_reasons, outcomes (see `outcome`), behaviour
    (`strop.env.grading.behaviour.summarize`), wall_s}; under a context strategy also `context`
    (`strop.env.harness.context.context_figures`) and `episodes` (task id -> {solved, reward, stop_reason,
    summaries: those its episode wrote ("summarize" only), facts_shown: per reset, the needed facts
    shown before it}); with `samples` K > 0 also `sampled`: {temperature, samples, pass@1, pass@k
    (k = K) with intervals, by_difficulty, behaviour}. With `rollouts`, the episodes are kept there
    (`eval_greedy`, `eval_sampled`: `strop runs show`)."""
    from strop.engine.engine import Engine

    tasks = eval_tasks(cfg) if tasks is None else tasks
    r = cfg.rollout
    engines = [
        Engine.from_checkpoint(policy_dir, max_batch=r.engine_batch, max_len=r.max_context, seed=cfg.run.seed)
        for _ in range(r.engines)
    ]
    engine = engines[0]
    greedy = Harness(engine.tokenizer, replace(harness_config(r, cfg.harness), temperature=r.eval_temperature))
    limits = sandbox_limits(r)
    difficulty = [int(t.metadata.get("difficulty", 0)) for t in tasks]
    t0 = time.perf_counter()
    for e in engines:
        e.start()
    freeze_long_lived()
    try:
        # greedy and sampled episodes in one pool: the engines batch them together, and the run has
        # one tail of stragglers instead of two
        episodes = [(greedy, t, WorkItem(t.id, f"eval-{t.id}", 0, cfg.run.seed, engine.version)) for t in tasks]
        if samples:
            sampler = Harness(engine.tokenizer, harness_config(r, cfg.harness))
            episodes += [
                (sampler, t, WorkItem(t.id, f"eval-{t.id}", k, cfg.run.seed * 1000 + k + 1, engine.version))
                for t in tasks
                for k in range(samples)
            ]
        desc = f"held-out eval {policy_dir}" + (f", greedy + {samples} samples per task" if samples else "")
        done = _run(engines, episodes, limits, r.workers, desc, progress)
        trajs, sampled = done[: len(tasks)], done[len(tasks) :]
    finally:
        for e in engines:
            e.stop()
    if rollouts is not None:
        rollouts.write("eval_greedy", [record(t) for t in trajs])
        if sampled:
            rollouts.write("eval_sampled", [record(t) for t in sampled])
    by_d: dict[int, list[bool]] = {}
    for d, traj in zip(difficulty, trajs):
        by_d.setdefault(d, []).append(counts_as_solved(traj))
    result = {
        **rate_figures([s for v in by_d.values() for s in v]),
        **reward_figures([held_out_reward(t) for t in trajs]),
        "by_difficulty": {str(d): rate_figures(v) for d, v in sorted(by_d.items())},
        "hacked": sum(t.hacked for t in trajs),
        "stop_reasons": dict(Counter(t.stop_reason for t in trajs).most_common()),
        "outcomes": dict(Counter(outcome(t) for t in trajs).most_common()),
        "behaviour": summarize([t.behaviour for t in trajs]),
    }
    if r.context_strategy != "none":
        result["context"] = context_figures([t.context for t in trajs])
        result["episodes"] = {
            t.task_id: {
                "solved": counts_as_solved(t),
                "reward": held_out_reward(t),
                "stop_reason": t.stop_reason,
                **{k: t.context[k] for k in ("summaries", "facts_shown")},
            }
            for t in trajs
        }
    if samples:
        per_task = [[counts_as_solved(t) for t in sampled[i * samples : (i + 1) * samples]] for i in range(len(tasks))]
        result["sampled"] = {
            "temperature": r.temperature,
            "samples": samples,
            **_pass_figures(per_task),
            "by_difficulty": {
                str(d): _pass_figures([p for p, dd in zip(per_task, difficulty) if dd == d])
                for d in sorted(set(difficulty))
            },
            "behaviour": summarize([t.behaviour for t in sampled]),
        }
        if r.context_strategy != "none":
            result["sampled"]["context"] = context_figures([t.context for t in sampled])
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if progress:
        print(
            f"[eval] {policy_dir}: solve rate {result['solve_rate']:.3f} {result['solve_rate_ci95']} "
            f"over {result['eval_episodes']} episodes",
            flush=True,
        )
    return result
