"""Isolated grading: the grader drives, the agent's code only answers.

Tests that run inside the process of the code they test can be fooled by that code: a return value
whose `__eq__` is always true passes every `assert f(x) == y`, a patched test runner reports passes
it never ran, an exit handler rewrites the report. Tasks graded by values (`Task.grader ==
"values"`: synthetic and humaneval) are scored without ever trusting that process:

1. the judge (a fresh sandbox that never holds the agent's code) runs the task's trusted check
   module, which exercises the code only through `call(module, function, *args)`, and lists the
   calls it needs answered;
2. the answerer (the checker's sandbox, over the agent's workspace) makes exactly those calls and
   writes each result as plain data, or the name of what it raised;
3. the judge runs the checks again with those answers, plain data it parsed itself, until no call
   is pending; its outcomes are the score.

The host only moves bytes between the two sandboxes: it never parses what the agent's code wrote,
and the checks and their expected values never enter the agent's sandbox. Both programs are in
`strop.env.grading.programs`.

Covered: any in-process trick (always-equal or other forged objects, monkeypatched runners or
builtins, exit calls, forged reports, fake output) earns nothing a correct value would not.
The judge's first round runs no code of the agent's: its verdict (which calls the checks make,
given no answers) follows from the check module alone, since `random` is reseeded before each check.
It is remembered per (image, check module) in this process (`FIRST_ROUNDS_KEPT` of them), so the
checks of a task graded again (a group's samples, the evaluations of each policy, the perturbed run
of every task that paid) cost two runs, the answerer's and the judge's last, where they cost three.

Not covered: special-casing the inputs a call receives at run time (the perturbed checks are there
for that); tasks graded by their own pytest suites (`mutated`) still run in-process.
"""

import functools
import json
import secrets
import threading
from collections import OrderedDict

from strop.env.sandbox.interface import Sandbox
from strop.memo import content_key

MAX_ROUNDS = 8  # rounds of calls whose arguments depend on earlier answers (one is the rule)
FIRST_ROUNDS_KEPT = 4096  # the judge's first verdicts remembered (a few KiB each): more tasks than a run grades
_first_rounds: OrderedDict[str, dict] = OrderedDict()
_first_rounds_lock = threading.Lock()  # rollout workers grade in threads


class GradingFailed(Exception):
    """The code under test gave no usable answers (timeout, exit before answering): reward 0."""


@functools.cache
def _programs() -> str:
    from pathlib import Path

    return (Path(__file__).parent / "programs.py").read_text()


def _python(sandbox: Sandbox, args: list[str], timeout: float):
    return sandbox.exec(["python", "-I", "-B", "-c", _programs(), *args], timeout=timeout)


def _remembered(key: str) -> dict | None:
    with _first_rounds_lock:
        verdict = _first_rounds.get(key)
        if verdict is not None:
            _first_rounds.move_to_end(key)
        return verdict


def _remember(key: str, verdict: dict) -> None:
    with _first_rounds_lock:
        _first_rounds[key] = verdict
        while len(_first_rounds) > FIRST_ROUNDS_KEPT:
            _first_rounds.popitem(last=False)


def _judge(judge: Sandbox, checks_path: str, verdict_path: str, rounds: list[str], timeout: float) -> dict:
    """The judge's verdict on the answers of `rounds` (calls and answers paths, in pairs)."""
    res = _python(judge, ["judge", checks_path, verdict_path, *rounds], timeout)
    if res.timed_out:  # a check looping on an answer (or the reference on a nudged input)
        raise GradingFailed(f"the checks did not finish within {timeout:.0f} s")
    try:
        return json.loads(judge.read_file(verdict_path))
    except (OSError, ValueError):
        raise RuntimeError(f"the judge failed (exit code {res.exit_code}): {res.stderr.strip()[-300:]}") from None


def grade(
    checks: str, answerer: Sandbox, judge: Sandbox, timeout: float, image: str = ""
) -> list[tuple[str, str, str]]:
    """(name, "passed" | "failed" | "error", detail) for every check in the module source `checks`,
    judged on the image `image` (a task's `image`: the key of its remembered first round);
    raises GradingFailed when the code under test gave no answers."""
    tag = secrets.token_hex(8)  # nothing the agent could have guessed or planted
    checks_path = f"/tmp/strop-checks-{tag}.py"
    judge.write_file(checks_path, checks)
    first = content_key(image, checks)
    rounds: list[str] = []
    for r in range(MAX_ROUNDS):
        verdict = _remembered(first) if r == 0 else None
        if verdict is None:
            verdict = _judge(judge, checks_path, f"/tmp/strop-verdict-{tag}-{r}.json", rounds, timeout)
            if r == 0:
                _remember(first, verdict)
        if not verdict["pending"]:
            return [tuple(c) for c in verdict["checks"]]
        calls = json.dumps(verdict["pending"])
        calls_path, answers_path = f"/tmp/strop-calls-{tag}-{r}.json", f"/tmp/strop-answers-{tag}-{r}.json"
        answerer.write_file(calls_path, calls)
        res = _python(answerer, ["answer", calls_path, answers_path], timeout)
        if res.timed_out:
            raise GradingFailed(f"timeout after {timeout:.0f} s")
        try:
            answers = answerer.read_file(answers_path)  # bytes the agent's code may have written: not parsed here
        except OSError:
            raise GradingFailed(f"the code under test gave no answers (exit code {res.exit_code})") from None
        judge.write_file(calls_path, calls)
        judge.write_file(answers_path, answers)
        rounds += [calls_path, answers_path]
    raise GradingFailed(f"calls still pending after {MAX_ROUNDS} rounds")
