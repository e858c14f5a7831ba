"""Demonstrations: the demonstrator of each task played through the real harness, tools and sandbox
(the chain suite's reads its own window, `strop.env.demonstrators.chain`; a task whose failing tests
are in its repository follows their traceback, `strop.env.demonstrators.trace`; every other task's
plays its reference solution, `strop.env.demonstrators.imperfect`), scored by the real checker: the
SFT warm start's data, and the demonstrator benchmarks."""

import functools
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from random import Random
from typing import Callable

from tqdm import tqdm

from strop.env.demonstrators.chain import ChainDemonstrator
from strop.env.demonstrators.imperfect import DemonstratorMix, DemoStyle, plan, rejected_as_planned
from strop.env.demonstrators.scripted import scripted_client
from strop.env.demonstrators.trace import TraceDemonstrator, traceable
from strop.env.episode import Episode
from strop.env.grading.checker import check as check_changes
from strop.env.harness.loop import Harness, HarnessConfig, run_task
from strop.env.sandbox.interface import Limits
from strop.env.task import Task
from strop.env.tasks.suites import load_suite, split_name

# room for every turn of a demonstration (an edit's whole text is one turn), which a policy's limits
# would cut short: the harness demonstrations run in unless a run asks for its own (summaries)
DEMONSTRATION_HARNESS = HarnessConfig(max_turns=20, max_context=2048, max_turn_tokens=512)


def demonstrator_client(task: Task, fmt, style: DemoStyle = DemoStyle(), trace: bool = True):
    """The demonstrator for one task in the harness's chat format `fmt`: `plan(task, style)` played
    turn by turn; a `chain` task's reads its own context window instead
    (`strop.env.demonstrators.chain`), and so does a task whose failing tests are in its repository
    (`strop.env.demonstrators.trace`: it follows their traceback), unless `trace` is False (the
    old opening, kept to measure against: `strop bench oracle --opening`)."""
    if task.suite == "chain":
        return ChainDemonstrator(task, fmt, careful=style.careful)
    if trace and traceable(task):
        return TraceDemonstrator(task, fmt, style)
    return scripted_client(plan(task, style), fmt)


def demonstration_episode(
    task: Task,
    tokenizer,
    config: HarnessConfig = DEMONSTRATION_HARNESS,
    limits: Limits = Limits(),
    style: DemoStyle = DemoStyle(),
) -> tuple[Episode, dict[str, bytes | None]]:
    """The demonstrator's episode on `task` through the real harness, tools and sandbox (its turns in
    the harness's chat format), and its changes."""
    return played(task, tokenizer, config, limits, style)[:2]


def played(
    task: Task, tokenizer, config: HarnessConfig, limits: Limits, style: DemoStyle, trace: bool = True
) -> tuple[Episode, dict[str, bytes | None], bool]:
    """`demonstration_episode`'s episode and changes, and whether the demonstrator found the code
    blind (by a name it never saw: `TraceDemonstrator.blind`)."""
    harness = Harness(tokenizer, config)
    client = demonstrator_client(task, harness.format, style, trace)
    episode, changes = run_task(harness, client, task, limits)
    return episode, changes, getattr(client, "blind", False)


def solve(
    tasks: list[Task],
    tokenizer,
    config: HarnessConfig = DEMONSTRATION_HARNESS,
    check: bool = True,
    progress: Callable[[int, dict], None] | None = None,
    mix: DemonstratorMix = DemonstratorMix(),
    workers: int = 1,
    seed: int = 0,
    trace: bool = True,
) -> dict:
    """Run the demonstrator on `tasks` (`trace`: see `demonstrator_client`), each in a style drawn
    from `mix` (seeded by `seed` and the task id), and score each episode with the real checker
    (unless `check` is False; then "solved" means submitted). `workers` episodes run at once
    (threads: their sandboxes and checker runs are child processes). Returns tasks, solved, rate,
    episodes_per_s (episodes alone, checking excluded, per worker), stop_reasons, styles (how many
    demonstrations were careful, had a wrong first attempt, recovered, went off plan, found the
    code blind), results (one dict per task, in order: id, difficulty, stop_reason, reward,
    reason, episode_s, tokens, careful, wrong, blind) and episodes (task id -> Episode: the solved
    ones that went as planned and not blind: a guess is not what a policy should learn)."""

    def one(task: Task) -> tuple[Task, Episode, dict]:
        style = mix.draw(task, Random(f"{seed}/{task.id}"))
        t = time.perf_counter()
        episode, changes, blind = played(task, tokenizer, config, Limits(), style, trace)
        episode_s = time.perf_counter() - t
        reason = episode.stop_reason + (f": {episode.detail}" if episode.detail else "")
        reward = 1.0 if episode.stop_reason == "submitted" else 0.0
        if check and reward:
            score = check_changes(task, changes, perturbed=False)
            reward, reason = score.reward, score.reason
        wrong = len(style.attempts)
        return (
            task,
            episode,
            {
                "id": task.id,
                "difficulty": task.metadata.get("difficulty"),
                "reward": reward,
                "stop_reason": episode.stop_reason,
                "reason": reason,
                "episode_s": episode_s,
                "tokens": max((len(s) for s in episode.segments), default=0),
                "careful": style.careful,
                "wrong": wrong,
                "as_planned": rejected_as_planned(episode, style),
                "blind": blind,
            },
        )

    report: dict = {
        "tasks": len(tasks),
        "solved": 0,
        "stop_reasons": {},
        "results": [],
        "episodes": {},
        "styles": {"careful": 0, "wrong_first": 0, "recovered": 0, "gave_up": 0, "off_plan": 0, "blind": 0},
    }
    styles = report["styles"]
    with ThreadPoolExecutor(workers) as pool:
        for i, (task, episode, result) in enumerate(pool.map(one, tasks)):
            report["stop_reasons"][episode.stop_reason] = report["stop_reasons"].get(episode.stop_reason, 0) + 1
            report["results"].append(result)
            styles["careful"] += result["careful"]
            styles["wrong_first"] += result["wrong"] > 0
            styles["recovered"] += result["wrong"] > 0 and result["careful"]
            styles["gave_up"] += result["wrong"] > 0 and not result["careful"]
            styles["off_plan"] += not result["as_planned"]
            styles["blind"] += result["blind"]
            if result["reward"] == 1.0:
                report["solved"] += 1
                if result["as_planned"] and not result["blind"]:
                    report["episodes"][task.id] = episode
            if progress:
                progress(i + 1, report)
    report["rate"] = report["solved"] / max(len(tasks), 1)
    total_s = sum(r["episode_s"] for r in report["results"])
    report["episodes_per_s"] = len(tasks) / total_s if total_s else 0.0
    return report


def collect_demonstrations(
    suite: str,
    split: str,
    tokenizer,
    limit: int | None = None,
    config: HarnessConfig = DEMONSTRATION_HARNESS,
    check: bool = True,
    mix: DemonstratorMix = DemonstratorMix(),
    workers: int = 1,
    difficulties: list[int] | None = None,
    seed: int = 0,
) -> tuple[list[Episode], dict]:
    """SFT warm-start demonstrations: the demonstrator's episodes (styles drawn from `mix`) on up to
    `limit` tasks of a suite split (of the given `difficulties`, all when None; interleaved) that the
    checker scores 1.0 — or, with `check=False`, that submitted, as unfiltered logs would hold them:
    a careless demonstrator's failed attempts included. Their `segments` are the training sequences,
    with loss on the demonstrator's turns only. Also returns the run's `styles` counts."""
    if (
        split_name(suite)[0] == "synthetic"
    ):  # it generates tasks per difficulty, `limit` of each: only as many as needed
        chosen = difficulties or [1, 2, 3]
        per = None if limit is None else -(-limit // len(chosen))
        tasks = [t for d in chosen for t in load_suite(suite, split, difficulty=d, limit=per)]
    else:
        tasks = [
            t for t in load_suite(suite, split) if not difficulties or t.metadata.get("difficulty") in difficulties
        ]
    by_difficulty: dict = {}
    for task in tasks:
        by_difficulty.setdefault(task.metadata.get("difficulty"), []).append(task)
    mixed = [t for group in itertools.zip_longest(*by_difficulty.values()) for t in group if t is not None]
    tasks = mixed[:limit]
    with tqdm(total=len(tasks), desc="demonstrations", unit="ep", dynamic_ncols=True) as bar:
        report = solve(
            tasks,
            tokenizer,
            config,
            check=check,
            mix=mix,
            workers=workers,
            seed=seed,
            progress=lambda done, _: bar.update(done - bar.n),
        )
    return list(report["episodes"].values()), report["styles"]


@functools.cache
def default_tokenizer():
    """A tokenizer of the configured default vocabulary trained on a 2 MB slice of the corpus
    (seconds), for benchmarks run without one."""
    from strop.config import DataSection
    from strop.data.corpus import load_corpus
    from strop.data.tokenizer import train_tokenizer

    data = DataSection()
    return train_tokenizer(load_corpus(data).train, vocab_size=data.vocab_size, sample_bytes=2_000_000)


def demonstration_episodes_per_s(n: int, tokenizer=None, suite: str = "synthetic", split: str = "eval") -> float:
    """Oracle episodes per second: `n` full episodes (sandbox start, every tool call, diff, close),
    checking excluded; tasks come from the suite split in order."""
    tokenizer = tokenizer or default_tokenizer()
    tasks = (
        load_suite(suite, split, limit=-(-n // 3)) if split_name(suite)[0] == "synthetic" else load_suite(suite, split)
    )
    tasks = (tasks * -(-n // max(len(tasks), 1)))[:n]
    harness = Harness(tokenizer, DEMONSTRATION_HARNESS)
    start = time.perf_counter()
    for task in tasks:
        episode, _ = run_task(harness, demonstrator_client(task, harness.format), task)
        assert episode.stop_reason == "submitted", (task.id, episode.stop_reason, episode.detail)
    return n / (time.perf_counter() - start)
