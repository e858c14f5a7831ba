"""The scripted oracle: a `PolicyClient` that solves a task through the real harness and tools
with the task's reference solution (`metadata["reference_edits"]`).

It behaves like a careful agent — locate the code (read the named file; or grep for the function
that the instruction, or the failing tests it names, point to; or list the repository), read the
file (whole when it is short, so the demonstration never relies on knowing the bug's line; else
around the bug), apply each edit with `edit_file`, run the visible tests, submit — and its turns
are real token ids (its intended assistant text, rendered in the chat format and encoded once by
the tokenizer), so its episodes are demonstration data for the SFT warm start and exercise exactly
the code path a trained policy does.
"""

import functools
import itertools
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from tqdm import tqdm

from strop.data.chat import GENERATION_PROMPT, IM_END, render_message
from strop.env.harness import Harness, HarnessConfig, run_task
from strop.env.policy import Generation, SamplingParams
from strop.env.sandbox import Limits
from strop.env.segment import Episode
from strop.env.task import Task

CONTEXT_LINES = 4  # lines read around an edit, each side, in a file too long to read whole
WHOLE_FILE_LINES = 100  # files up to this long are read whole: the bug's line is not something an agent knows
_TEST_FILE = re.compile(r"(^|/)(test_[^/]*|[^/]*_test)\.py$")


def _call(content: str, name: str, **arguments) -> dict:
    call = {"id": "", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": content, "tool_calls": [call]}


def plan(task: Task, run_tests: bool = True) -> list[dict]:
    """The oracle's assistant messages for `task`, in order."""
    edits = task.metadata.get("reference_edits")
    assert edits, f"task {task.id} has no reference_edits"
    turns = []
    first = edits[0]["path"]
    function = task.metadata.get("function")
    named_tests = [p for p in task.files if _TEST_FILE.search(p) and p in task.instruction]
    if first not in task.instruction:
        if function and function not in task.instruction and named_tests:  # the failing test names it
            turns.append(_call("Let me run the failing tests.", "run",
                               command=f"python -m pytest -q --tb=no {named_tests[0]} | grep FAILED"))
        if function:
            turns.append(_call(f"Let me find `{function}`.", "grep", pattern=f"def {function}\\("))
        else:
            turns.append(_call("Let me look at the repository.", "list_dir", path="."))
    files = dict(task.files)
    for i, edit in enumerate(edits):
        path, text = edit["path"], files.get(edit["path"], "")
        if i == 0 or path != edits[i - 1]["path"]:
            if text.count("\n") <= WHOLE_FILE_LINES:  # what an agent can do without knowing where the bug is
                turns.append(_call(f"I'll read `{path}`.", "read_file", path=path))
            else:
                at = text.find(edit["old"])
                line = text.count("\n", 0, max(at, 0)) + 1
                end = line + edit["old"].count("\n") + CONTEXT_LINES
                turns.append(_call(f"I'll read `{path}`.", "read_file", path=path, start=max(1, line - CONTEXT_LINES),
                                   end=end))
        turns.append(_call("Here is the bug; fixing it." if i == 0 else "And this part.", "edit_file",
                           path=path, old=edit["old"], new=edit["new"]))
        files[path] = text.replace(edit["old"], edit["new"], 1)
    if run_tests and any(_TEST_FILE.search(p) for p in task.files):
        turns.append(_call("Now the tests.", "run", command="python -m pytest -q"))
    turns.append(_call("Done.", "submit"))
    return turns


class ScriptedClient:
    """A `PolicyClient` that plays fixed assistant texts, one per turn (then repeats the last),
    each encoded once by the tokenizer and ended with <|im_end|> when it lacks one. Its tokens
    get logprob 0.0 (demonstrations are certain) and version `version`."""

    def __init__(self, texts: list[str], tokenizer, version: int = 0):
        assert texts, "a script needs at least one turn"
        self.texts, self.tokenizer, self.version = texts, tokenizer, version
        self.next = 0

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        text = self.texts[min(self.next, len(self.texts) - 1)]
        self.next += 1
        ids = self.tokenizer.encode(text if text.endswith(IM_END) else text + IM_END, add_special_tokens=False)
        finish = "stop" if len(ids) <= params.max_tokens else "length"
        ids = ids[: params.max_tokens]
        return Generation(ids, [0.0] * len(ids), [self.version] * len(ids),
                          self.tokenizer.decode(ids, skip_special_tokens=False), finish_reason=finish)


def assistant_text(message: dict) -> str:
    """What a policy generates for `message`: its rendering after the generation prompt, through <|im_end|>."""
    return render_message(message)[len(GENERATION_PROMPT):-1]


def oracle_client(task: Task, tokenizer, run_tests: bool = True) -> ScriptedClient:
    """The oracle for one task: `plan(task)` played turn by turn."""
    return ScriptedClient([assistant_text(m) for m in plan(task, run_tests)], tokenizer)


def oracle_episode(task: Task, tokenizer, config: HarnessConfig = HarnessConfig(), limits: Limits = Limits(),
                   run_tests: bool = True) -> tuple[Episode, dict[str, bytes | None]]:
    """The oracle's episode on `task` through the real harness, tools and sandbox, and its changes."""
    return run_task(Harness(tokenizer, config), oracle_client(task, tokenizer, run_tests), task, limits)


def solve(tasks: list[Task], tokenizer, config: HarnessConfig = HarnessConfig(), check: bool = True,
          progress: Callable[[int, dict], None] | None = None, run_tests: bool = True, workers: int = 1) -> dict:
    """Run the oracle on `tasks` and score each episode with the real checker (unless `check` is
    False; then "solved" means submitted); with `run_tests` False the oracle submits without running
    the visible tests. `workers` episodes run at once (threads: their sandboxes and checker runs
    are child processes). Returns tasks, solved, rate, episodes_per_s (episodes alone, checking
    excluded, per worker), stop_reasons, results (one dict per task, in order: id, difficulty,
    stop_reason, reward, reason, episode_s) and episodes (task id -> Episode, solved ones only)."""
    from strop.env.checker import check as check_changes

    def one(task: Task) -> tuple[Task, Episode, dict]:
        t = time.perf_counter()
        episode, changes = oracle_episode(task, tokenizer, config, run_tests=run_tests)
        episode_s = time.perf_counter() - t
        reason = episode.stop_reason + (f": {episode.detail}" if episode.detail else "")
        reward = 1.0 if episode.stop_reason == "submitted" else 0.0
        if check and reward:
            score = check_changes(task, changes, perturbed=False)
            reward, reason = score.reward, score.reason
        return task, episode, {"id": task.id, "difficulty": task.metadata.get("difficulty"), "reward": reward,
                               "stop_reason": episode.stop_reason, "reason": reason, "episode_s": episode_s,
                               "tokens": max((len(s) for s in episode.segments), default=0)}

    report: dict = {"tasks": len(tasks), "solved": 0, "stop_reasons": {}, "results": [], "episodes": {}}
    with ThreadPoolExecutor(workers) as pool:
        for i, (task, episode, result) in enumerate(pool.map(one, tasks)):
            report["stop_reasons"][episode.stop_reason] = report["stop_reasons"].get(episode.stop_reason, 0) + 1
            report["results"].append(result)
            if result["reward"] == 1.0:
                report["solved"] += 1
                report["episodes"][task.id] = episode
            if progress:
                progress(i + 1, report)
    report["rate"] = report["solved"] / max(len(tasks), 1)
    total_s = sum(r["episode_s"] for r in report["results"])
    report["episodes_per_s"] = len(tasks) / total_s if total_s else 0.0
    return report


def oracle_traces(suite: str, split: str, tokenizer, limit: int | None = None, config: HarnessConfig = HarnessConfig(),
                  check: bool = True, run_tests: bool = True, workers: int = 1,
                  difficulties: list[int] | None = None) -> list[Episode]:
    """SFT warm-start demonstrations: the oracle's episodes on up to `limit` tasks of a suite split
    (of the given `difficulties`, all when None; interleaved) that the checker scores 1.0 (with
    `check=False`, that submitted: half the cost, no verification). Their `segments` are the training
    sequences, with loss on the oracle's turns only."""
    from strop.env.suites import load_suite, split_name

    if split_name(suite)[0] == "synthetic":  # it generates tasks per difficulty, `limit` of each: only as many as needed
        chosen = difficulties or [1, 2, 3]
        per = None if limit is None else -(-limit // len(chosen))
        tasks = [t for d in chosen for t in load_suite(suite, split, difficulty=d, limit=per)]
    else:
        tasks = [t for t in load_suite(suite, split) if not difficulties or t.metadata.get("difficulty") in difficulties]
    by_difficulty: dict = {}
    for task in tasks:
        by_difficulty.setdefault(task.metadata.get("difficulty"), []).append(task)
    mixed = [t for group in itertools.zip_longest(*by_difficulty.values()) for t in group if t is not None]
    tasks = mixed[:limit]
    with tqdm(total=len(tasks), desc="oracle demonstrations", unit="ep", dynamic_ncols=True) as bar:
        report = solve(tasks, tokenizer, config, check=check, run_tests=run_tests, workers=workers,
                       progress=lambda done, _: bar.update(done - bar.n))
    return list(report["episodes"].values())


@functools.cache
def default_tokenizer():
    """A tokenizer of the configured default vocabulary trained on a 2 MB slice of the corpus
    (seconds), for benchmarks run without one."""
    from strop.config import DataSection
    from strop.data.corpus import load_corpus
    from strop.data.tokenizer import train_tokenizer

    data = DataSection()
    return train_tokenizer(load_corpus(data).train, vocab_size=data.vocab_size, sample_bytes=2_000_000)


def run_oracle_episodes(n: int, tokenizer=None, suite: str = "synthetic", split: str = "eval") -> float:
    """Oracle episodes per second: `n` full episodes (sandbox start, every tool call, diff, close),
    checking excluded; tasks come from the suite split in order."""
    from strop.env.suites import load_suite, split_name

    tokenizer = tokenizer or default_tokenizer()
    tasks = load_suite(suite, split, limit=-(-n // 3)) if split_name(suite)[0] == "synthetic" else load_suite(suite, split)
    tasks = (tasks * -(-n // max(len(tasks), 1)))[:n]
    harness = Harness(tokenizer)
    start = time.perf_counter()
    for task in tasks:
        episode, _ = run_task(harness, oracle_client(task, tokenizer), task)
        assert episode.stop_reason == "submitted", (task.id, episode.stop_reason, episode.detail)
    return n / (time.perf_counter() - start)
