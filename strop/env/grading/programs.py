"""The two programs of isolated grading (see `strop.env.grading.isolated`), run inside sandboxes as
`python -I -c <this file's source> answer|judge ...`. Standard library only: the sandbox's Python
has no strop.

answer CALLS OUT (in the sandbox holding the agent's code, cwd = the repository): for each call
[module, function, args] in CALLS, import the module, call the function, and write to OUT either
{"value": <the result as plain data>} or {"raised": <exception type name>}. Anything that is not
plain data (an object whose `__eq__` is always true, a generator, a class instance) cannot be
written: it is reported as raised `Unserializable`. The agent's code can do anything to this
process, and so to what it writes; it cannot know what the judge expects.

judge CHECKS OUT [CALLS RESULTS]... (in a fresh sandbox that never held the agent's code): exec
the trusted check module CHECKS, which defines `CHECKS`, a list of (name, function(call)); run
each with `call(module, function, *args)` answering from the RESULTS of earlier rounds, and write
{"checks": [[name, "passed" | "failed" | "error", detail]], "pending": [calls not answered yet]}
to OUT. A call not answered yet returns a `Pending` stand-in (equal to anything), so one run finds
every call a check makes that does not depend on an earlier answer; the caller answers them and
judges again until nothing is pending, and only then are the outcomes final. So that a failed
assert does not hide the calls after it (`assert not f(x)` fails on a stand-in), the check module,
and the source it runs through `run_source` (humaneval's official check), have their asserts
compiled to record the failure and go on: a check with a failed assert fails, one without passes,
exactly as with raising asserts.

Plain data, tagged in JSON so that the judge gets back exactly the type the code returned: None,
bool, int, float (NaN and infinities included), str, and lists, tuples, dicts, sets, frozensets
and bytes of them, at most `MAX_DEPTH` deep. `type(v) is ...`, never isinstance: a subclass of
int with a forged `__eq__` is refused, not passed on as the int it claims to be.
"""

import base64
import builtins
import json
import sys

# `ast` and `random` are the judge's alone, imported where it uses them: the answerer, which starts
# for every check, is spared their ~12 ms of imports

MAX_DEPTH = 64
SEED = 0  # `random` is reseeded before each check, so every run of a check draws the same arguments


class Unserializable(TypeError):
    """A value that is not plain data."""


def encode(v, depth: int = 0):
    if depth > MAX_DEPTH:
        raise Unserializable(f"nested deeper than {MAX_DEPTH}")
    t = type(v)
    if v is None or t in (bool, int, str):
        return v
    if t is float:
        return {"float": repr(v)}  # repr round-trips every float, NaN and infinities too
    if t is list:
        return [encode(x, depth + 1) for x in v]
    if t in (tuple, set, frozenset):
        return {t.__name__: [encode(x, depth + 1) for x in v]}
    if t is dict:
        return {"dict": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"bytes": base64.b64encode(v).decode()}
    raise Unserializable(f"a {t.__module__}.{t.__qualname__} is not plain data")


def decode(d, depth: int = 0):
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH}")
    if d is None or type(d) in (bool, int, str):
        return d
    if type(d) is list:
        return [decode(x, depth + 1) for x in d]
    if type(d) is not dict or len(d) != 1:
        raise ValueError("not an encoded value")
    ((tag, body),) = d.items()
    if tag == "float":
        return float(body)
    if tag == "bytes":
        return base64.b64decode(body)
    if tag not in ("dict", "tuple", "set", "frozenset") or type(body) is not list:
        raise ValueError(f"not an encoded value (tag {tag!r})")
    if tag == "dict":
        if not all(type(kv) is list and len(kv) == 2 for kv in body):
            raise ValueError("a dict entry is not a pair")
        return {decode(k, depth + 1): decode(x, depth + 1) for k, x in body}
    return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](decode(x, depth + 1) for x in body)


def answer(calls_path: str, out_path: str) -> None:
    import importlib
    import os

    sys.path.insert(0, os.getcwd())  # the repository (python -I left the working directory out)
    with open(calls_path) as f:
        calls = json.load(f)
    results = []
    for module, function, args in calls:
        try:
            value = getattr(importlib.import_module(module), function)(*decode(args))
            results.append({"value": encode(value)})
        except BaseException as e:  # SystemExit, pytest's Skipped, anything the code raises: its answer
            results.append({"raised": type(e).__name__})
    text = json.dumps(results)
    with open(out_path, "w") as f:
        f.write(text)


class Pending:
    """Stands in for a result not known yet: equal to anything and absorbing every operation, so a
    check runs on past it and makes its other calls."""

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __lt__ = __le__ = __gt__ = __ge__ = __contains__ = __eq__

    def __bool__(self):
        return True

    def __len__(self):
        return 0

    def __iter__(self):
        return iter(())

    def __int__(self):
        return 0

    __index__ = __int__

    def __float__(self):
        return 0.0

    def __hash__(self):
        return 0

    def _absorb(self, *args, **kwargs):
        return self

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _absorb
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __neg__ = __pos__ = _absorb
    __abs__ = __round__ = __getitem__ = __call__ = __and__ = __or__ = __xor__ = __invert__ = _absorb
    __getattr__ = _absorb


class _Blocked(Exception):
    """A call whose arguments hold a pending result: it can be made once that one is answered."""


def _contains_pending(v, depth: int = 0) -> bool:
    if isinstance(v, Pending):
        return True
    if depth < MAX_DEPTH and type(v) in (list, tuple, set, frozenset):
        return any(_contains_pending(x, depth + 1) for x in v)
    if depth < MAX_DEPTH and type(v) is dict:
        return any(_contains_pending(k, depth + 1) or _contains_pending(x, depth + 1) for k, x in v.items())
    return False


_failures: list[str] = []  # asserts that failed in the check running now


def _strop_failed(message) -> None:
    _failures.append("assertion failed" if message is None else str(message)[:200])


def run_source(source: str, ns: dict, name: str = "checks") -> None:
    """exec `source` in `ns` with its asserts recording failures instead of raising."""
    import ast

    class SoftAsserts(ast.NodeTransformer):
        """`assert test, msg` -> `if not (test): _strop_failed(msg)`."""

        def visit_Assert(self, node: ast.Assert) -> ast.If:
            record = ast.Call(ast.Name("_strop_failed", ast.Load()), [node.msg or ast.Constant(None)], [])
            return ast.copy_location(ast.If(ast.UnaryOp(ast.Not(), node.test), [ast.Expr(record)], []), node)

    tree = ast.fix_missing_locations(SoftAsserts().visit(ast.parse(source)))
    ns.update(_strop_failed=_strop_failed, run_source=run_source)
    exec(compile(tree, name, "exec"), ns)


def judge(checks_path: str, out_path: str, rounds: list[str]) -> None:
    import random

    known: dict[str, dict] = {}
    for calls_path, results_path in zip(rounds[::2], rounds[1::2]):
        with open(calls_path) as f:
            calls = json.load(f)
        try:
            with open(results_path) as f:
                results = json.load(f)
        except (OSError, ValueError, RecursionError):
            results = []
        if type(results) is not list:
            results = []
        for i, c in enumerate(calls):
            got = results[i] if i < len(results) else None
            ok = type(got) is dict and len(got) == 1 and (("value" in got) or type(got.get("raised")) is str)
            known[json.dumps(c)] = got if ok else {"raised": "NoAnswer"}
    pending: dict[str, list] = {}

    def call(module: str, function: str, *args):
        if _contains_pending(args):
            raise _Blocked()
        c = [module, function, encode(list(args))]
        key = json.dumps(c)
        if key not in known:
            pending.setdefault(key, c)
            return Pending()
        got = known[key]
        if "value" in got:
            try:
                return decode(got["value"])
            except (ValueError, TypeError, RecursionError):
                raise Unserializable("the answer could not be read") from None
        kind = getattr(builtins, got["raised"], None)
        if isinstance(kind, type) and issubclass(kind, Exception) and kind.__module__ == "builtins":
            raise kind("raised by the code under test")
        raise RuntimeError(f"the code under test raised {got['raised']}")

    ns: dict = {}
    with open(checks_path) as f:
        run_source(f.read(), ns)
    outcomes = []
    for name, check in ns["CHECKS"]:
        random.seed(SEED)
        _failures.clear()
        try:
            check(call)
            outcomes.append([name, "failed", _failures[0]] if _failures else [name, "passed", ""])
        except AssertionError as e:  # raised by hand, not by an assert statement
            outcomes.append([name, "failed", str(e)[:200]])
        except _Blocked:
            outcomes.append([name, "error", "waits on an answer"])
        except BaseException as e:
            outcomes.append([name, "error", f"{type(e).__name__}: {str(e)[:200]}"])
    with open(out_path, "w") as f:
        json.dump({"checks": outcomes, "pending": list(pending.values())}, f)


if __name__ == "__main__":
    if sys.argv[1] == "answer":
        answer(sys.argv[2], sys.argv[3])
    else:
        judge(sys.argv[2], sys.argv[3], sys.argv[4:])
