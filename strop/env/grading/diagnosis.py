"""Why a test run gave no verdict on the code, in the user's terms: the runner's own last words (a
module the image lacks, the memory limit, a test id that names no test), with the task field that
decides it, so that a reason reads `no such test id in FAIL_TO_PASS: tests/test_m.py::test_nope` or
`memory limit reached (memory_mb = 300): MemoryError`, not `no junit report (exit code 127)`.

The reasons start with their kind, then a colon and the detail: evaluation groups reasons by what
comes before the first colon (`strop.rl.evaluate.outcome`).
"""

from strop.env.sandbox.interface import Limits
from strop.env.task import Task

# what a process says when its address space (`Limits.memory_mb`, RLIMIT_AS) runs out: Python's
# exception, the dynamic loader's and libc's words, C++'s
MEMORY_SIGNS = ("MemoryError", "failed to map segment", "annot allocate memory", "out of memory", "bad_alloc")
KILLED = (137, -9)  # SIGKILL: the CPU limit's hard end (`Limits.cpu_s`) or a signal from outside
SEGFAULT = (139, -11)  # SIGSEGV: deep recursion past the C stack, or an allocation RLIMIT_AS refused unchecked
LINE = 200  # characters of the runner's words kept in a reason


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= LINE else text[: LINE - 3] + "..."


def telling_line(output: str) -> str:
    """The line of a runner's output that says most: one naming a memory failure or a missing
    module, else the last non-empty line ("" for no output)."""
    lines = [line for line in output.splitlines() if line.strip()]
    for signs in (MEMORY_SIGNS, ("No module named",)):
        found = [line for line in lines if any(s in line for s in signs)]
        if found:
            return _clip(found[-1])
    return _clip(lines[-1]) if lines else ""


def memory_reason(text: str, limits: Limits) -> str | None:
    """`memory limit reached (memory_mb = N): ...` when `text` shows the memory limit was hit."""
    if any(s in text for s in MEMORY_SIGNS):
        return f"memory limit reached (memory_mb = {limits.memory_mb}): {telling_line(text)}"
    return None


def no_report_reason(exit_code: int | None, stderr: str, limits: Limits) -> str:
    """The reason of a test run that wrote no report: the memory limit, a runner the image lacks,
    a kill, or the runner's last words with its exit code."""
    words = telling_line(stderr)
    if (memory := memory_reason(stderr, limits)) is not None:
        return memory
    if "No module named pytest" in words or "No module named 'pytest'" in words:
        return f"no pytest in the image (the task's image or test_command): {words}"
    if exit_code in SEGFAULT:
        why = f"a stack overflow or the memory limit (memory_mb = {limits.memory_mb})"
        return f"crashed (exit code {exit_code}, SIGSEGV): {why}" + (f": {words}" if words else "")
    if exit_code in KILLED:
        return f"killed (exit code {exit_code}): the CPU limit (cpu_s = {limits.cpu_s}) or a signal"
    return f"no junit report (exit code {exit_code})" + (f": {words}" if words else "")


def _reported(test_id: str, outcomes: dict[str, str]) -> bool:
    """Whether a report says anything of `test_id`: its own outcome or its module's import error,
    or for an id naming a file, any of the file's tests."""
    if "::" not in test_id:
        return test_id in outcomes or any(t.startswith(test_id + "::") for t in outcomes)
    return test_id in outcomes or test_id.partition("::")[0] in outcomes


def unknown_tests_reason(task: Task, selected: list[str], outcomes: dict[str, str]) -> str | None:
    """`no such test id in FAIL_TO_PASS: ...` when test ids of the task's FAIL_TO_PASS or PASS_TO_PASS
    among `selected` are absent from a report; None when every one is there."""
    named = set(task.fail_to_pass) | set(task.pass_to_pass)
    missing = [t for t in selected if t in named and not _reported(t, outcomes)]
    if not missing:
        return None
    field = "FAIL_TO_PASS" if missing[0] in task.fail_to_pass else "PASS_TO_PASS"
    more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
    ids = "s" if len(missing) > 1 else ""
    listed = ", ".join(missing[:3]) + more
    return f"no such test id{ids} in {field}: {listed} (ids are path::name from the repository's top)"
