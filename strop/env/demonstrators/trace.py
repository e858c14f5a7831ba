"""The demonstrator of tasks whose failing tests are in a repository world (synthesized by `strop
tasks synth`, or mined without hidden tests): a `PolicyClient` that finds the bug from the failing
tests' traceback, deciding each reply from the context window it is shown, so every argument it
writes (a path, a test id, a function's name, a line number, an edit's old text) is something the
window showed it first.

An agent is told only which tests fail (`strop.env.tasks.statement`); the buggy function is 1 to 9
calls below them. So, like a developer:

1. it runs the first failing test the statement names (one whose message is an error raised in the
   code before one that failed its own assertion: `pytest -x -q --tb=short ID | head`), unless the
   statement's own traceback already points into the code on the way to the bug;
2. it follows a *lead* the window shows: a traceback frame or grep hit (`path:line`) in a function
   of the repository, which it reads in a line range (`read_file` with start and end: the bug's
   function whole when it fits, a function on the way from its `def` to the call that leads on);
   a failing test's frame, read from the test's `def` to the failing line; or a name in code or
   output it has seen (not in its own words), whose definition it greps for (`(def|class) NAME\b`);
3. once the window shows the bug's lines, it makes the edit (in the style `DemoStyle` draws:
   misremembered first, careless, ...: `strop.env.demonstrators.imperfect`), runs the failing
   tests again, and submits. A fix that changes several functions (a combined bug) is one edit per
   function; when no lead to the next one is in view it runs a failing test again for one.

Which lead is the right one it decides with the gold patch (it is a demonstrator): the function
holding the next edit, and a static call graph of the starting repository (`CodeIndex`: each
function's distance, in references by name, to that function). Among the leads in view it takes the
nearest; a location to read before a name to grep at the same distance. When nothing in view
reaches the bug (a call through a variable, say), or after `MAX_LEADS` leads, it falls back to the
old opening, a grep for the buggy function's name, and says so in `blind`: `strop.env.
demonstrators.runs` counts those and leaves them out of the SFT data.
"""

import ast
import difflib
import functools
import os
import re
import shlex
from dataclasses import dataclass, field

from strop.confined import read_beneath
from strop.env.demonstrators.imperfect import FIRST_EDIT, RETRY, SUBMIT, DemoStyle
from strop.env.demonstrators.scripted import ScriptedClient, assistant_text, tool_call_message
from strop.env.runner import is_test_path
from strop.env.task import Task
from strop.env.world.patches import reference_edit, reference_edits, starting_text
from strop.env.world.repo import apply_patch, checkout
from strop.policy_api import Generation, SamplingParams

MAX_SPAN = 40  # lines of a function read in one go; a longer one is read around what matters
AROUND = 8  # lines read before a line of interest in a long function (and half as many after)
MAX_LEADS = 16  # reads and greps before it gives up following leads and greps blind
READ_CHARS = 1800  # a read must show whole under the harness's observation limit (2,000 chars)
MERGE_LINES = 6  # hunks of a fix closer than this are one edit
# a location the window shows: "path.py:12: in f" (a short traceback), "path.py:12: Error" (a long
# one), "path.py:12:def f(" (a grep hit)
LOCATION = re.compile(r"(?<![\w./-])([\w./-]+\.py):(\d+):")
NAME = re.compile(r"[A-Za-z_]\w*")
HEAD_LINES = 15  # of the first run's output: its first failure
RUN_SAY = "Let me run the failing test."
RERUN_SAY = "Now the failing tests."


@dataclass(frozen=True)
class Node:
    """A function or class of the repository: where it is and the names its body refers to."""

    name: str
    path: str
    start: int  # its `def`/`class` line
    end: int
    refs: frozenset[str]


def file_nodes(path: str, text: str) -> list[Node]:
    """The functions and classes of one Python file (none when it does not parse)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    nodes = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            refs = {m.id for m in ast.walk(n) if isinstance(m, ast.Name)}
            refs |= {m.attr for m in ast.walk(n) if isinstance(m, ast.Attribute)}
            if isinstance(n, ast.ClassDef):  # calling a class runs its methods (__init__ and the rest)
                refs |= {m.name for m in n.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
            nodes.append(Node(n.name, path, n.lineno, n.end_lineno or n.lineno, frozenset(refs - {n.name})))
    return nodes


@dataclass
class CodeIndex:
    """The source files of a repository (tests left out) as `Node`s, by path."""

    nodes: dict[str, list[Node]] = field(default_factory=dict)

    def update(self, path: str, text: str) -> None:
        self.nodes[path] = file_nodes(path, text)

    def at(self, path: str, line: int) -> Node | None:
        """The innermost function or class holding `line` of `path`."""
        inside = [n for n in self.nodes.get(path, []) if n.start <= line <= n.end]
        return min(inside, key=lambda n: n.end - n.start, default=None)

    def distances(self, target: Node) -> dict[Node, int]:
        """Each node's distance to `target`: 0 for it, 1 for a node that refers to its name, ..."""
        dist = {target: 0}
        frontier = {target.name}
        d = 0
        everything = [n for nodes in self.nodes.values() for n in nodes]
        while frontier:
            d += 1
            new = [n for n in everything if n not in dist and n.refs & frontier]
            dist |= {n: d for n in new}
            frontier = {n.name for n in new}
        return dist


@functools.lru_cache(maxsize=8)
def _starting_sources(repo: str, commit: str, start_patch: str) -> dict[str, str]:
    """The Python source files (tests left out) of a repository at `commit` with `start_patch` applied."""
    tree = checkout(repo, commit)
    texts: dict[str, str] = {}
    for root, dirs, files in os.walk(tree):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for rel in (os.path.relpath(os.path.join(root, f), tree) for f in files if f.endswith(".py")):
            if not is_test_path(rel) and (data := read_beneath(tree, rel, links=False)) is not None:
                texts[rel] = data.decode(errors="replace")
    for rel, data in (apply_patch(tree, start_patch) if start_patch else {}).items():
        if rel.endswith(".py") and not is_test_path(rel):
            texts.pop(rel, None)
            if data is not None:
                texts[rel] = data.decode(errors="replace")
    return texts


def code_index(task: Task) -> CodeIndex:
    """The index of `task`'s starting repository (its `files` written over it)."""
    index = CodeIndex()
    sources = dict(_starting_sources(task.repo, task.base_commit, task.start_patch)) if task.repo else {}
    sources |= {p: t for p, t in task.files.items() if p.endswith(".py") and not is_test_path(p)}
    for path, text in sources.items():
        index.update(path, text)
    return index


def hunk_edits(task: Task) -> list[dict]:
    """The task's reference edits, one per function the fix changes (hunks closer than
    `MERGE_LINES` lines together), each unique in the file as the earlier ones leave it: the parts
    of a combined bug are found and fixed one at a time."""
    out = []
    for edit in reference_edits(task):
        if not edit["old"]:
            out.append(edit)
            continue
        text = starting_text(task, edit["path"])
        fixed = text.replace(edit["old"], edit["new"], 1)
        a, b = text.splitlines(keepends=True), fixed.splitlines(keepends=True)
        nodes = CodeIndex({edit["path"]: file_nodes(edit["path"], text)})
        groups: list[list[tuple]] = []
        for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
            if op[0] == "equal":
                continue
            near = groups and op[1] - groups[-1][-1][2] < MERGE_LINES
            if groups and (near or nodes.at(edit["path"], op[1] + 1) == nodes.at(edit["path"], groups[-1][0][1] + 1)):
                groups[-1].append(op)  # one function's changes are one edit: its half-made states may not parse
            else:
                groups.append([op])
        current = a
        for g in groups:  # each hunk applied to the text the earlier ones left
            shift = len(current) - len(a)
            i1, i2, j1, j2 = g[0][1], g[-1][2], g[0][3], g[-1][4]
            after = current[: i1 + shift] + b[j1:j2] + current[i2 + shift :]
            old, new = reference_edit("".join(current), "".join(after))
            out.append({"path": edit["path"], "old": old, "new": new})
            current = after
    return out


def traceable(task: Task) -> bool:
    """Whether `task` is this demonstrator's: a repository world whose failing tests are in it (no
    hidden tests) and named by the statement."""
    return bool(task.repo and not task.test_patch and not task.hidden_tests) and any(
        t in task.instruction for t in task.fail_to_pass
    )


def _asserted(instruction: str, test: str) -> bool:
    """Whether the statement says `test` failed its own assertion (an AssertionError)."""
    line = next((l for l in instruction.splitlines() if l.startswith(f"{test}: ")), "")
    return line[len(test) + 2 :].startswith("AssertionError")


def locations(window: str) -> list[tuple[str, int]]:
    """The `path:line` locations the window shows, in order, first sightings only."""
    seen: dict[tuple[str, int], None] = {}
    for m in LOCATION.finditer(window):
        seen.setdefault((m.group(1).removeprefix("./"), int(m.group(2))), None)
    return list(seen)


class TraceDemonstrator:
    """A `PolicyClient` for one task (see the module docstring) in the harness's chat format `fmt`,
    in `style`; `blind` says whether it had to grep for the buggy function by a name it never saw."""

    def __init__(self, task: Task, fmt, style: DemoStyle = DemoStyle(), version: int = 0):
        self.task, self.fmt, self.style, self.version = task, fmt, style, version
        self.edits = hunk_edits(task)
        assert self.edits, f"task {task.id} has no reference solution (reference_edits or a gold patch)"
        self.index = code_index(task)
        self.texts = {e["path"]: starting_text(task, e["path"]) for e in self.edits}
        # the failing tests it can see, those whose message is an error raised in the code (not
        # the test's own assertion) first: their traceback goes down into the code
        named = [t for t in task.fail_to_pass if t in task.instruction]
        self.tests = sorted(named, key=lambda t: _asserted(task.instruction, t))
        self.said: list[str] = []  # its own turns: a name it wrote itself is no lead
        self.done = 0  # edits made
        self.ran = False  # the failing tests ran since the last edit
        self.read: set[tuple[str, int, int]] = set()
        self.grepped: set[str] = set()
        self.leads = 0
        self.blind = False
        self.finished = False
        self.wrong = list(style.attempts)  # rejected first attempts still to make
        self.say = FIRST_EDIT

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        window = self.fmt.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        text = assistant_text(self.next_message(window), self.fmt)
        self.said.append(text)
        return ScriptedClient([text], self.fmt.tokenizer, self.version, self.fmt.end_text).generate(prompt_ids, params)

    def next_message(self, window: str) -> dict:
        """The next turn given the window (the module docstring's steps)."""
        if self.finished:
            return tool_call_message(SUBMIT, "submit")
        if self.done == len(self.edits):
            if self.style.run_tests and not self.ran and self.tests:
                return self._run_tests(RERUN_SAY, first_only=False)
            self.finished = True
            return tool_call_message(SUBMIT, "submit")
        edit = self.edits[self.done]
        if not edit["old"] or self._in_view(edit, window):  # a new file has nothing to find
            return self._edit(edit)
        target = self._target(edit)
        first = self.done == 0 and self.leads == 0
        if first and not self.ran and self.tests and not self._located(window, target):
            return self._run_tests(RUN_SAY, first_only=True)  # the opening: what does the test say?
        lead = self._lead(window, target) if self.leads < MAX_LEADS else None
        if lead is None and not self.ran and self.tests:
            return self._run_tests(RERUN_SAY, first_only=True)
        self.leads += 1
        if lead is not None:
            return lead
        self.blind = True  # nothing in view reaches the bug: the old guess
        if target.name and target.name not in self.grepped:
            return self._grep(target.name)
        return self._read_range(target.path, self._target_range(edit, target, None), target)

    def _run_tests(self, say: str, first_only: bool) -> dict:
        self.ran = True
        if first_only:  # its first failure (and a test of many subtests fails many times)
            command = f"python -m pytest -x -q --tb=short {shlex.quote(self.tests[0])} | head -n {HEAD_LINES}"
        else:
            command = f"python -m pytest -q --tb=short {shlex.join(self.tests)}"
        return tool_call_message(say, "run", command=command)

    def _located(self, window: str, target: Node) -> bool:
        """Whether the window already shows a location in code on the way to the bug (a
        statement with a traceback)."""
        dist = self.index.distances(target)
        return any(self.index.at(p, l) in dist for p, l in locations(window))

    def _grep(self, name: str) -> dict:
        self.grepped.add(name)
        return tool_call_message(f"Let me find `{name}`.", "grep", pattern=f"(def|class) {name}\\b")

    def _edit_lines(self, edit: dict) -> tuple[int, int]:
        text = self.texts[edit["path"]]
        first = text.count("\n", 0, text.find(edit["old"])) + 1
        return first, first + edit["old"].rstrip("\n").count("\n")

    def _covered(self, path: str, start: int, end: int) -> bool:
        return any(p == path and s <= start and end <= e for p, s, e in self.read)

    def _in_view(self, edit: dict, window: str) -> bool:
        lines = [l for l in edit["old"].splitlines() if l.strip()]
        return self._covered(edit["path"], *self._edit_lines(edit)) and all(l in window for l in lines)

    def _target(self, edit: dict) -> Node:
        """The function holding the edit (its first changed line); else the one just above it (a
        removed `return` leaves its function ending before the edit's lines); else the file."""
        start, end = self._edit_lines(edit)
        above = [n for n in self.index.nodes.get(edit["path"], []) if n.start <= start]
        node = self.index.at(edit["path"], start) or max(above, key=lambda n: (n.end, n.start - n.end), default=None)
        return node or Node("", edit["path"], 1, end, frozenset())

    def _fits(self, path: str, span: tuple[int, int]) -> bool:
        lines = self._text(path).splitlines()[span[0] - 1 : span[1]]
        return span[1] - span[0] < MAX_SPAN and sum(len(l) + 8 for l in lines) <= READ_CHARS

    def _first_fitting(self, path: str, spans: list[tuple[int, int]]) -> tuple[int, int]:
        spans = [(max(1, s), e) for s, e in spans]
        return next((s for s in spans if self._fits(path, s)), spans[-1])

    def _target_range(self, edit: dict, target: Node, anchor: int | None) -> tuple[int, int]:
        """The bug's function whole, else from the line the lead showed to the bug, else around the bug."""
        start, end = self._edit_lines(edit)
        spans = [(min(start, target.start), max(end, target.end))]
        if anchor is not None:
            spans.append((min(start, anchor) - 2, max(end, anchor) + 2))
        return self._first_fitting(target.path, spans + [(start - AROUND, end + AROUND // 2), (start - 1, end + 1)])

    def _node_range(self, node: Node, line: int, dist: dict[Node, int]) -> tuple[int, int]:
        """A function on the way to the bug: from its `def` (or the line the lead showed) to its
        first reference to a name one step nearer, else around that reference."""
        nearer = {n.name for n, d in dist.items() if d == dist[node] - 1}
        text = self._text(node.path).splitlines()
        body = range(node.start + 1, node.end + 1)
        at = next((i for i in body if set(NAME.findall(text[i - 1])) & nearer), node.end)
        start = line if line < at else node.start
        return self._first_fitting(node.path, [(start, at + 2), (at - AROUND, at + 2), (at - 2, at + 2)])

    def _text(self, path: str) -> str:
        return self.texts.get(path) or starting_text(self.task, path)

    def _lead(self, window: str, target: Node) -> dict | None:
        """The nearest lead in view (a location to read, else a name to grep) as the next turn,
        None when nothing in view leads to the bug. A failing test's frame counts as one call above
        the nearest name its test refers to."""
        dist = self.index.distances(target)
        by_name: dict[str, int] = {}
        for n, d in dist.items():
            by_name[n.name] = min(d, by_name.get(n.name, d))
        best: tuple | None = None
        read_defs = [
            (p, n.start) for p, s, e in sorted(self.read) for n in self.index.nodes.get(p, []) if s <= n.start <= e
        ]
        for order, (path, line) in enumerate(locations(window) + read_defs):
            node, d = self.index.at(path, line), -1
            if node is not None and node in dist:
                d = dist[node]
            elif is_test_path(path):  # a test: one call above the nearest name it refers to
                node = CodeIndex({path: file_nodes(path, self._text(path))}).at(path, line)
                d = 1 + min((by_name[r] for r in node.refs if r in by_name), default=-2) if node else -1
            if d < 0 or self._was_read(node, target):
                continue
            if best is None or (2 * d, order) < best[0]:
                best = ((2 * d, order), node, line)
        seen = window.split(self.task.instruction[:40], 1)[-1]  # the instruction on: not the tool list
        for text in self.said:
            seen = seen.replace(text.strip(), "")
        for order, name in enumerate(dict.fromkeys(NAME.findall(seen))):
            if name in by_name and name not in self.grepped:
                if best is None or (2 * by_name[name] + 1, order) < best[0]:
                    best = ((2 * by_name[name] + 1, order), name, None)
        if best is None:
            return None
        _, what, line = best
        if isinstance(what, str):
            return self._grep(what)
        if is_test_path(what.path):  # from its `def` (at most `2 * AROUND` lines up) to the failing line
            return self._read_range(what.path, (max(what.start, line - 2 * AROUND), line + 1), None)
        if what == target:
            return self._read_range(what.path, self._target_range(self.edits[self.done], target, line), what)
        return self._read_range(what.path, self._node_range(what, line, dist), what)

    def _was_read(self, node: Node, target: Node) -> bool:
        if node == target:  # read enough only once the edit is in view (`_in_view`)
            return self._covered(node.path, *self._edit_lines(self.edits[self.done]))
        return any(p == node.path and s <= node.end and node.start <= e for p, s, e in self.read)

    def _read_range(self, path: str, span: tuple[int, int], node: Node | None) -> dict:
        self.read.add((path, *span))
        what = f"`{node.name}` in `{path}`" if node is not None else f"`{path}`"
        return tool_call_message(f"I'll read {what}.", "read_file", path=path, start=span[0], end=span[1])

    def _edit(self, edit: dict) -> dict:
        path = edit["path"]
        if not edit["old"]:
            self.done += 1
            return tool_call_message(f"I'll write `{path}`.", "write_file", path=path, content=edit["new"])
        if self.done == 0 and self.wrong:
            wrong = self.wrong.pop(0)
            say, self.say = self.say, RETRY[wrong["kind"]]
            self.finished = not self.style.careful  # a careless demonstrator submits after it
            return tool_call_message(say, "edit_file", path=wrong["path"], old=wrong["old"], new=wrong["new"])
        say, self.say = self.say, "And this part."
        self.texts[path] = self.texts[path].replace(edit["old"], edit["new"], 1)
        self.index.update(path, self.texts[path])
        self.done += 1
        self.ran = False
        return tool_call_message(say, "edit_file", path=path, old=edit["old"], new=edit["new"])
