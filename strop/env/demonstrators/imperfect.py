"""The demonstrator of bug-fix tasks, deliberately imperfect: a `PolicyClient` that works a task
through the real harness and tools with the task's reference solution (`metadata["reference_edits"]`,
or the edits of its gold patch: `strop.env.world.patches.reference_edits`), with a configurable
share of the mistakes real logged traces have.

A task whose failing tests are in its repository (synthesized from a project's code) is the
traceback-following demonstrator's (`strop.env.demonstrators.trace`, which draws its mistakes from
the same `DemoStyle`): the opening below greps for a function the statement of such a task never
names.

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

import re
from dataclasses import dataclass
from random import Random

from strop.env.demonstrators.scripted import tool_call_message
from strop.env.episode import Episode
from strop.env.harness.coding_tools import closest_lines
from strop.env.runner import is_test_module
from strop.env.task import Task
from strop.env.world.patches import reference_edits, starting_text

CONTEXT_LINES = 4  # lines read around an edit, each side, in a file too long to read whole
WHOLE_FILE_LINES = 100  # files up to this long are read whole: the bug's line is not something an agent knows
FIRST_EDIT = "Here is the bug; fixing it."
RETRY = {"suspect": "Not in the file: the bug is elsewhere.", "misremember": "I'll copy the exact text it shows."}
SUBMIT = "Done."


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
    named_tests = [p for p in task.files if is_test_module(p) and p in task.instruction]
    if first not in task.instruction:
        if function and function not in task.instruction and named_tests:  # the failing test names it
            turns.append(
                tool_call_message(
                    "Let me run the failing tests.",
                    "run",
                    command=f"python -m pytest -q --tb=no {named_tests[0]} | grep FAILED",
                )
            )
        if function:
            turns.append(tool_call_message(f"Let me find `{function}`.", "grep", pattern=f"def {function}\\("))
        else:
            turns.append(tool_call_message("Let me look at the repository.", "list_dir", path="."))
    files = {e["path"]: starting_text(task, e["path"]) for e in edits}
    for i, edit in enumerate(edits):
        path, text = edit["path"], files[edit["path"]]
        if not edit["old"]:  # a new file
            turns.append(tool_call_message(f"I'll write `{path}`.", "write_file", path=path, content=edit["new"]))
            continue
        if i == 0 or path != edits[i - 1]["path"]:
            if text.count("\n") <= WHOLE_FILE_LINES:  # what an agent can do without knowing where the bug is
                turns.append(tool_call_message(f"I'll read `{path}`.", "read_file", path=path))
            else:
                at = text.find(edit["old"])
                line = text.count("\n", 0, max(at, 0)) + 1
                end = line + edit["old"].count("\n") + CONTEXT_LINES
                turns.append(
                    tool_call_message(
                        f"I'll read `{path}`.", "read_file", path=path, start=max(1, line - CONTEXT_LINES), end=end
                    )
                )
        say = FIRST_EDIT if i == 0 else "And this part."
        if i == 0:
            for wrong in style.attempts:
                turns.append(
                    tool_call_message(say, "edit_file", path=wrong["path"], old=wrong["old"], new=wrong["new"])
                )
                if not style.careful:
                    return turns + [tool_call_message(SUBMIT, "submit")]
                say = RETRY[wrong["kind"]]
        turns.append(tool_call_message(say, "edit_file", path=path, old=edit["old"], new=edit["new"]))
        files[path] = text.replace(edit["old"], edit["new"], 1)
    if style.run_tests and any(is_test_module(p) for p in task.files):
        turns.append(tool_call_message("Now the tests.", "run", command="python -m pytest -q"))
    turns.append(tool_call_message(SUBMIT, "submit"))
    return turns


def rejected_as_planned(episode: Episode, style: DemoStyle) -> bool:
    """Whether `edit_file` rejected exactly the planned wrong attempts and accepted every other call."""
    errors = [c["error"] is not None for c in episode.tool_calls]
    wrong = len(style.attempts)
    edits = [i for i, c in enumerate(episode.tool_calls) if c["name"] == "edit_file"]
    return sum(errors) == wrong and all(errors[i] for i in edits[:wrong])
