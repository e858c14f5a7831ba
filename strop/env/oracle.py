"""The scripted demonstrator: a `PolicyClient` that works a task through the real harness and
tools with the task's reference solution (`metadata["reference_edits"]`, or the edits of its gold
patch: `strop.env.world.reference_edits`), with a configurable share of the mistakes real logged
traces have.

At its best (the default `DemoStyle`) it behaves like a careful agent — locate the code (read the
named file; or grep for the function that the instruction, or the failing tests it names, point
to; or list the repository), read the file (whole when it is short, so the demonstration never
relies on knowing the bug's line; else around the bug), apply each edit with `edit_file`, run the
visible tests, submit. Its turns are real token ids (its intended assistant text, rendered in the
chat format and encoded once by the tokenizer), so its episodes are demonstration data for the SFT
warm start and exercise exactly the code path a trained policy does.

Logged traces of people and agents are of mixed quality, and a warm start cloned from a flawless
oracle has nothing for RL to sharpen (it never recovers, because it never needed to). So a
`DemonstratorMix` draws each demonstration's `DemoStyle`:

- instead of finding the bug by reading, a demonstrator checks the usual suspects with probability
  `suspects`: the function's known bugs in the library's order (`metadata["suspect_edits"]`), so
  every one ahead of the injected bug is an edit whose old text is not in the file;
- it misremembers the right line's text (indentation, quotes, spacing) with probability
  `misremember`.
Either way `edit_file` rejects the attempt (for a misremembered line the error shows the closest
text). A careful demonstrator (probability `careful`) reads the error and tries again — the next
suspect, or the exact text the error shows — up to `max_wrong` rejected attempts, and runs the
visible tests before submitting; a careless one submits after its first rejected attempt, so the
bug stays in place.

Both kinds say the same things up to the first decision that tells them apart, so the policy
cloned from the mixture recovers with about the probability `careful` — sometimes, which is what
RL turns into reliably (pass@k into pass@1).
"""

import functools
import itertools
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from random import Random
from typing import Callable

from tqdm import tqdm

from strop.data.chat import GENERATION_PROMPT, IM_END, render_message
from strop.env.coding_tools import closest_lines
from strop.env.harness import Harness, HarnessConfig, run_task
from strop.env.sandbox import Limits
from strop.env.segment import Episode
from strop.env.task import Task
from strop.env.world import reference_edits, starting_text
from strop.policy_api import Generation, SamplingParams

CONTEXT_LINES = 4  # lines read around an edit, each side, in a file too long to read whole
WHOLE_FILE_LINES = 100  # files up to this long are read whole: the bug's line is not something an agent knows
_TEST_FILE = re.compile(r"(^|/)(test_[^/]*|[^/]*_test)\.py$")
FIRST_EDIT = "Here is the bug; fixing it."
RETRY = {"suspect": "Not in the file: the bug is elsewhere.", "misremember": "I'll copy the exact text it shows."}
SUBMIT = "Done."


def _call(content: str, name: str, **arguments) -> dict:
    call = {"id": "", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": content, "tool_calls": [call]}


@dataclass(frozen=True)
class DemoStyle:
    """How one demonstration goes. `wrong` are the attempts `edit_file` rejects, in order, each a
    reference-edit-like dict with a `kind` ("suspect" or "misremember"); a careless demonstrator
    makes only the first of them and submits."""

    careful: bool = True
    run_tests: bool = True
    wrong: tuple[dict, ...] = ()

    @property
    def attempts(self) -> tuple[dict, ...]:
        """The wrong attempts it actually makes: all of them, or only the first when careless."""
        return self.wrong if self.careful else self.wrong[:1]


@dataclass(frozen=True)
class DemonstratorMix:
    """The population of demonstrators the SFT data is drawn from (see the module docstring)."""

    careful: float = 1.0
    suspects: float = 0.0
    misremember: float = 0.0
    max_wrong: int = 2  # the harness ends an episode after 3 rejected turns in a row (max_invalid_turns)
    run_tests: bool = True

    def draw(self, task: Task, rng: Random) -> DemoStyle:
        careful = rng.random() < self.careful
        wrong: list[dict] = []
        if rng.random() < self.suspects:
            wrong += [{**s, "kind": "suspect"} for s in task.metadata.get("suspect_edits", []) if s["before"]]
        if rng.random() < self.misremember and (slip := misremembered(task, rng)) is not None:
            wrong.append(slip)
        return DemoStyle(
            careful=careful,
            run_tests=self.run_tests and careful,
            wrong=tuple(wrong[: self.max_wrong if careful else 1]),
        )


def _slips(old: str, rng: Random) -> list[str]:
    """Ways to misremember `old`: one indentation level too deep, the other quote style, or the
    spacing around one operator or comma."""
    out = ["".join("    " + line if line.strip() else line for line in old.splitlines(keepends=True))]
    if '"' in old or "'" in old:
        out.append(old.translate(str.maketrans({'"': "'", "'": '"'})))
    spots = [m for m in re.finditer(r" ?([=<>+\-*/%,]) ?", old)]
    if spots:
        m = rng.choice(spots)
        out.append(
            old[: m.start()] + m.group(1) + old[m.end() :]
            if m.group(0) != m.group(1)
            else old[: m.start()] + f" {m.group(1)} " + old[m.end() :]
        )
    return out


def misremembered(task: Task, rng: Random) -> dict | None:
    """The first reference edit with its old text misremembered so that `edit_file` rejects it and
    shows the right lines as the closest text; None when no slip does both."""
    edit = reference_edits(task)[0]
    text = starting_text(task, edit["path"])
    slips = _slips(edit["old"], rng)
    rng.shuffle(slips)
    want = edit["old"].strip("\n").splitlines()
    for old in slips:
        shown = closest_lines(text, old)
        if old != edit["old"] and text.count(old) == 0 and [l.split("| ", 1)[1] for l in shown] == want:
            return {"path": edit["path"], "old": old, "new": edit["new"], "kind": "misremember"}
    return None


def plan(task: Task, style: DemoStyle = DemoStyle()) -> list[dict]:
    """The demonstrator's assistant messages for `task` in `style`, in order."""
    edits = reference_edits(task)
    assert edits, f"task {task.id} has no reference solution (reference_edits or a gold patch)"
    turns = []
    first = edits[0]["path"]
    function = task.metadata.get("function")
    named_tests = [p for p in task.files if _TEST_FILE.search(p) and p in task.instruction]
    if first not in task.instruction:
        if function and function not in task.instruction and named_tests:  # the failing test names it
            turns.append(
                _call(
                    "Let me run the failing tests.",
                    "run",
                    command=f"python -m pytest -q --tb=no {named_tests[0]} | grep FAILED",
                )
            )
        if function:
            turns.append(_call(f"Let me find `{function}`.", "grep", pattern=f"def {function}\\("))
        else:
            turns.append(_call("Let me look at the repository.", "list_dir", path="."))
    files = {e["path"]: starting_text(task, e["path"]) for e in edits}
    for i, edit in enumerate(edits):
        path, text = edit["path"], files[edit["path"]]
        if not edit["old"]:  # a new file
            turns.append(_call(f"I'll write `{path}`.", "write_file", path=path, content=edit["new"]))
            continue
        if i == 0 or path != edits[i - 1]["path"]:
            if text.count("\n") <= WHOLE_FILE_LINES:  # what an agent can do without knowing where the bug is
                turns.append(_call(f"I'll read `{path}`.", "read_file", path=path))
            else:
                at = text.find(edit["old"])
                line = text.count("\n", 0, max(at, 0)) + 1
                end = line + edit["old"].count("\n") + CONTEXT_LINES
                turns.append(
                    _call(f"I'll read `{path}`.", "read_file", path=path, start=max(1, line - CONTEXT_LINES), end=end)
                )
        say = FIRST_EDIT if i == 0 else "And this part."
        if i == 0:
            for wrong in style.attempts:
                turns.append(_call(say, "edit_file", path=wrong["path"], old=wrong["old"], new=wrong["new"]))
                if not style.careful:
                    return turns + [_call(SUBMIT, "submit")]
                say = RETRY[wrong["kind"]]
        turns.append(_call(say, "edit_file", path=path, old=edit["old"], new=edit["new"]))
        files[path] = text.replace(edit["old"], edit["new"], 1)
    if style.run_tests and any(_TEST_FILE.search(p) for p in task.files):
        turns.append(_call("Now the tests.", "run", command="python -m pytest -q"))
    turns.append(_call(SUBMIT, "submit"))
    return turns


def rejected_as_planned(episode: Episode, style: DemoStyle) -> bool:
    """Whether `edit_file` rejected exactly the planned wrong attempts and accepted every other call."""
    errors = [c["error"] is not None for c in episode.tool_calls]
    wrong = len(style.attempts)
    edits = [i for i, c in enumerate(episode.tool_calls) if c["name"] == "edit_file"]
    return sum(errors) == wrong and all(errors[i] for i in edits[:wrong])


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
        return Generation(
            ids,
            [0.0] * len(ids),
            [self.version] * len(ids),
            self.tokenizer.decode(ids, skip_special_tokens=False),
            finish_reason=finish,
        )


def assistant_text(message: dict) -> str:
    """What a policy generates for `message`: its rendering after the generation prompt, through <|im_end|>."""
    return render_message(message)[len(GENERATION_PROMPT) : -1]


def oracle_client(task: Task, tokenizer, style: DemoStyle = DemoStyle()):
    """The demonstrator for one task: `plan(task, style)` played turn by turn; a `chain` task's reads
    its own context window instead (`strop.env.chain_oracle`)."""
    if task.suite == "chain":
        from strop.env.chain_oracle import ChainDemonstrator

        return ChainDemonstrator(task, tokenizer, careful=style.careful)
    return ScriptedClient([assistant_text(m) for m in plan(task, style)], tokenizer)


def oracle_episode(
    task: Task,
    tokenizer,
    config: HarnessConfig = HarnessConfig(),
    limits: Limits = Limits(),
    style: DemoStyle = DemoStyle(),
) -> tuple[Episode, dict[str, bytes | None]]:
    """The demonstrator's episode on `task` through the real harness, tools and sandbox, and its changes."""
    return run_task(Harness(tokenizer, config), oracle_client(task, tokenizer, style), task, limits)


def solve(
    tasks: list[Task],
    tokenizer,
    config: HarnessConfig = HarnessConfig(),
    check: bool = True,
    progress: Callable[[int, dict], None] | None = None,
    mix: DemonstratorMix = DemonstratorMix(),
    workers: int = 1,
    seed: int = 0,
) -> dict:
    """Run the demonstrator on `tasks`, each in a style drawn from `mix` (seeded by `seed` and the
    task id), and score each episode with the real checker (unless `check` is False; then "solved"
    means submitted). `workers` episodes run at once (threads: their sandboxes and checker runs are
    child processes). Returns tasks, solved, rate, episodes_per_s (episodes alone, checking
    excluded, per worker), stop_reasons, styles (how many demonstrations were careful, had a wrong
    first attempt, recovered, went off plan), results (one dict per task, in order: id,
    difficulty, stop_reason, reward, reason, episode_s, tokens, careful, wrong) and episodes (task
    id -> Episode: the solved ones that went as planned)."""
    from strop.env.checker import check as check_changes

    def one(task: Task) -> tuple[Task, Episode, dict]:
        style = mix.draw(task, Random(f"{seed}/{task.id}"))
        t = time.perf_counter()
        episode, changes = oracle_episode(task, tokenizer, config, style=style)
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
            },
        )

    report: dict = {
        "tasks": len(tasks),
        "solved": 0,
        "stop_reasons": {},
        "results": [],
        "episodes": {},
        "styles": {"careful": 0, "wrong_first": 0, "recovered": 0, "gave_up": 0, "off_plan": 0},
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
            if result["reward"] == 1.0:
                report["solved"] += 1
                if result["as_planned"]:
                    report["episodes"][task.id] = episode
            if progress:
                progress(i + 1, report)
    report["rate"] = report["solved"] / max(len(tasks), 1)
    total_s = sum(r["episode_s"] for r in report["results"])
    report["episodes_per_s"] = len(tasks) / total_s if total_s else 0.0
    return report


def oracle_traces(
    suite: str,
    split: str,
    tokenizer,
    limit: int | None = None,
    config: HarnessConfig = HarnessConfig(),
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
    from strop.env.suites import load_suite, split_name

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


def run_oracle_episodes(n: int, tokenizer=None, suite: str = "synthetic", split: str = "eval") -> float:
    """Oracle episodes per second: `n` full episodes (sandbox start, every tool call, diff, close),
    checking excluded; tasks come from the suite split in order."""
    from strop.env.suites import load_suite, split_name

    tokenizer = tokenizer or default_tokenizer()
    tasks = (
        load_suite(suite, split, limit=-(-n // 3)) if split_name(suite)[0] == "synthetic" else load_suite(suite, split)
    )
    tasks = (tasks * -(-n // max(len(tasks), 1)))[:n]
    harness = Harness(tokenizer)
    start = time.perf_counter()
    for task in tasks:
        episode, _ = run_task(harness, oracle_client(task, tokenizer), task)
        assert episode.stop_reason == "submitted", (task.id, episode.stop_reason, episode.detail)
    return n / (time.perf_counter() - start)
