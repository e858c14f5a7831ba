"""The `synthetic` suite: small generated Python packages with one injected bug each.

A task is a package of `difficulty` modules (1-3), each holding 3 functions of one theme
from `synthetic_lib`, with one bug of one family injected into one function. Hidden checks
are cases over every function whose expected values come from running the correct code, graded
by values (`strop.env.grading.isolated`: the expected values never enter the agent's sandbox);
the perturbed variant uses fresh random inputs. A bug is kept only when
the hidden tests and the perturbed tests both catch it, checked here by running both
versions in-process (the library is our own pure code).

Difficulty 1: one module, a visible test that fails, an instruction naming the function and a
failing call. 2: two modules, a failing visible test, an instruction naming only the test file.
3: three modules, visible tests of the other functions only, an instruction quoting a user's
failing call. Everything derives from `random.Random("synthetic/{difficulty}/{split}/{i}")`.

The variant `synthetic/parse` (themes joined by "+") draws every bug from functions of those
themes only, with its own seeds and ids (`synthetic-parse-d1-train-0007`): fewer distinct bugs,
so a few hundred demonstrations show each of them many times.
"""

import copy
import functools
import hashlib
from random import Random

from strop.env.suites.synthetic_lib import FAMILIES, LIBRARY, Fn
from strop.env.task import Task
from strop.env.world.patches import reference_edit
from strop.errors import UserError

SIZES = {"train": 2000, "eval": 300}
DIFFICULTIES = (1, 2, 3)
PACKAGES = ["toolbox", "utilkit", "corelib", "helpers", "pyutils", "commons", "basekit", "libtools"]
MODULES = {
    "math": ["mathutil", "numeric", "calc"],
    "text": ["strings", "textops", "formatting"],
    "parse": ["parsing", "readers", "decode"],
    "seq": ["seqs", "listops", "collections_ext"],
}
THEME_DOC = {
    "math": "Small numeric helpers.",
    "text": "String helpers.",
    "parse": "Parsers for small text formats.",
    "seq": "List and sequence helpers.",
}
VARIANT = "bug themes joined by '+' (math, text, parse, seq)"
FUNCS_PER_MODULE = 3
N_CASES = 6  # random hidden cases per function, on top of its edge cases


@functools.cache
def _compile(fn_src: str, name: str):
    ns: dict = {}
    exec(fn_src, ns)  # our own library code, never agent code
    return ns[name]


def _call(fn_src: str, name: str, args: tuple):
    """(ok, value) of calling `name` defined by `fn_src` on a copy of args."""
    try:
        return True, _compile(fn_src, name)(*copy.deepcopy(args))
    except Exception as e:  # a bug that raises is a caught bug
        return False, type(e).__name__


def _cases(fn: Fn, rng: Random, n: int, with_edges: bool) -> list[tuple[tuple, object]]:
    """Distinct (args, expected) pairs on which the correct function returns normally."""
    out, seen = [], set()
    candidates = (list(fn.edges) if with_edges else []) + [fn.gen(rng) for _ in range(n * 3)]
    for args in candidates:
        ok, value = _call(fn.src, fn.name, args)
        if ok and repr(args) not in seen and len(out) < n + (len(fn.edges) if with_edges else 0):
            seen.add(repr(args))
            out.append((args, value))
    return out


def _failing(src: str, name: str, cases: list[tuple[tuple, object]]) -> list[tuple[tuple, object, str]]:
    """The cases a (buggy) source gets wrong, with what it returned instead."""
    bad = []
    for args, expected in cases:
        ok, got = _call(src, name, args)
        if not ok or got != expected:  # the tests compare with ==, so must this
            bad.append((args, expected, repr(got) if ok else f"raises {got}"))
    return bad


def _test_file(pkg: str, by_module: dict[str, list[Fn]], cases: dict[str, list]) -> str:
    lines = ["import pytest", ""]
    for mod, fns in by_module.items():
        names = [f.name for f in fns if f.name in cases]
        if names:
            lines.append(f"from {pkg}.{mod} import {', '.join(names)}")
    for mod, fns in by_module.items():
        for f in fns:
            if f.name not in cases:
                continue
            rows = "".join(f"\n    ({args!r}, {expected!r})," for args, expected in cases[f.name])
            lines += [
                "",
                "",
                f'@pytest.mark.parametrize("args, expected", [{rows}\n])',
                f"def test_{f.name}(args, expected):",
                f"    assert {f.name}(*args) == expected",
            ]
    return "\n".join(lines) + "\n"


CHECKS_MODULE = '''"""Hidden checks, run by strop's judge: the code under test only answers `call` (see
strop.env.grading.isolated)."""

CASES = [  # (module, function, args, expected)
{rows}]


def _case(module, function, args, expected):
    def check(call):
        assert call(module, function, *args) == expected, "wrong value"
    return f"{{module}}.{{function}}{{args!r}}", check


CHECKS = [_case(*case) for case in CASES]
'''


def _checks_module(pkg: str, by_module: dict[str, list[Fn]], cases: dict[str, list]) -> str:
    """The hidden checks of `cases` as a check module graded by values (one check per case)."""
    rows = "".join(
        f"    ({f'{pkg}.{mod}'!r}, {f.name!r}, {args!r}, {expected!r}),\n"
        for mod, fns in by_module.items()
        for f in fns
        for args, expected in cases.get(f.name, [])
    )
    return CHECKS_MODULE.format(rows=rows)


def _module_src(theme: str, fns: list[Fn]) -> str:
    return f'"""{THEME_DOC[theme]}"""\n' + "".join("\n" + f.src for f in fns)


def _instruction(difficulty: int, pkg: str, path: str, fn: Fn, failing: tuple, test_path: str) -> str:
    args, expected, got = failing
    call = f"{fn.name}({', '.join(repr(a) for a in args)})"
    if difficulty == 1:
        return (
            f"The function `{fn.name}` in `{path}` has a bug: `{call}` returns {got} but should return "
            f"{expected!r}. Fix the function. Do not edit the tests."
        )
    if difficulty == 2:
        return f"Tests in `{test_path}` fail. Find the bug in the `{pkg}` package and fix it. Do not edit the tests."
    return (
        f"A user of the `{pkg}` package reports: `{call}` gives {got}, expected {expected!r}. "
        "Find the bug and fix it without changing other behaviour."
    )


def library_files(themes: tuple[str, ...], package: str = "toolbox", cases: int = N_CASES) -> dict[str, str]:
    """The library's functions of `themes` as one repository without a bug: a module per theme under
    `package/` and a test module per theme under `tests/` whose cases (edge cases and `cases` random
    ones, expected values from the correct code) check every function. What `strop tasks synth` makes
    tasks from in `strop bench curriculum`: real tests of the demo's kind of code."""
    files = {f"{package}/__init__.py": ""}
    for theme in themes:
        fns = [f for f in LIBRARY if f.theme == theme]
        module = MODULES[theme][0]
        rng = Random(f"library/{theme}")
        files[f"{package}/{module}.py"] = _module_src(theme, fns)
        checked = {f.name: _cases(f, rng, cases, with_edges=True) for f in fns}
        files[f"tests/test_{module}.py"] = _test_file(package, {module: fns}, checked)
    return files


def parse_themes(variant: str) -> tuple[str, ...]:
    """ "parse+seq" -> ("parse", "seq"); "" -> () (every theme)."""
    themes = tuple(sorted(set(variant.split("+")))) if variant else ()
    unknown = [t for t in themes if t not in MODULES]
    if unknown:
        raise UserError(f"unknown synthetic theme {unknown[0]!r}; choose from {', '.join(MODULES)} (joined by '+')")
    return themes


def make_task(difficulty: int, split: str, index: int, themes: tuple[str, ...] = ()) -> Task:
    """Task `index` of (difficulty, split), its bug in a function of `themes` (any when empty); deterministic."""
    assert difficulty in DIFFICULTIES, difficulty
    rng = Random(f"synthetic/{'+'.join(themes) + '/' if themes else ''}{difficulty}/{split}/{index}")
    while True:  # rejection sampling: a few bug/input draws fail verification
        task = _attempt(rng, difficulty, split, index, themes)
        if task is not None:
            return task


def _attempt(rng: Random, difficulty: int, split: str, index: int, bug_themes: tuple[str, ...]) -> Task | None:
    pool = [f for f in LIBRARY if not bug_themes or f.theme in bug_themes]
    family = rng.choice([fam for fam in FAMILIES if any(fam in f.bugs for f in pool)])
    target = rng.choice([f for f in pool if family in f.bugs])
    old, new = rng.choice(target.bugs[family])
    assert target.src.count(old) == 1, (target.name, old)
    pkg = rng.choice(PACKAGES)
    themes = [target.theme] + rng.sample([t for t in MODULES if t != target.theme], difficulty - 1)
    by_module: dict[str, list[Fn]] = {}
    for theme in themes:
        pool = [f for f in LIBRARY if f.theme == theme and f is not target]
        fns = rng.sample(pool, FUNCS_PER_MODULE - (theme == target.theme))
        if theme == target.theme:
            fns.insert(rng.randint(0, len(fns)), target)
        by_module[rng.choice(MODULES[theme])] = fns
    target_mod = next(m for m, fns in by_module.items() if target in fns)
    buggy_src = target.src.replace(old, new)

    hidden = {f.name: _cases(f, rng, N_CASES, True) for fns in by_module.values() for f in fns}
    perturbed = {f.name: _cases(f, rng, N_CASES, False) for fns in by_module.values() for f in fns}
    caught, caught_perturbed = (
        _failing(buggy_src, target.name, hidden[target.name]),
        _failing(buggy_src, target.name, perturbed[target.name]),
    )
    if not caught or not caught_perturbed:
        return None  # the bug is invisible to these inputs: draw again
    failing = caught[0]

    files: dict[str, str] = {f"{pkg}/__init__.py": f'"""{pkg}: small utilities."""\n'}
    for mod, fns in by_module.items():
        files[f"{pkg}/{mod}.py"] = _module_src(fns[0].theme, fns)
    path = f"{pkg}/{target_mod}.py"
    fixed = files[path]
    files[path] = fixed.replace(target.src, buggy_src)
    test_path = f"tests/test_{target_mod}.py"
    if difficulty < 3:  # visible tests: two cases per function of the target module plus the failing one
        visible = {f.name: hidden[f.name][:2] for f in by_module[target_mod]}
        visible[target.name] = [(failing[0], failing[1])] + [c for c in hidden[target.name][:2] if c[0] != failing[0]][
            :1
        ]
        files[test_path] = _test_file(pkg, {target_mod: by_module[target_mod]}, visible)
    else:  # visible tests of the other modules only: they pass and give no hint
        others = {m: fns for m, fns in by_module.items() if m != target_mod}
        visible = {f.name: hidden[f.name][:2] for fns in others.values() for f in fns}
        test_path = f"tests/test_{pkg}.py"
        files[test_path] = _test_file(pkg, others, visible)

    ref_old, ref_new = reference_edit(files[path], fixed)
    suspects = _suspect_edits(target, (old, new), files[path], fixed, path)
    hidden_path = "tests/test_hidden.py"
    return Task(
        id=f"synthetic-{'+'.join(bug_themes) + '-' if bug_themes else ''}d{difficulty}-{split}-{index:04d}",
        suite="synthetic",
        split=split,
        instruction=_instruction(difficulty, pkg, path, target, failing, test_path),
        files=files,
        hidden_tests={hidden_path: _checks_module(pkg, by_module, hidden)},
        perturbed_tests={hidden_path: _checks_module(pkg, by_module, perturbed)},
        grader="values",
        metadata={
            "family": family,
            "difficulty": difficulty,
            "function": target.name,
            "path": path,
            "n_tests": sum(map(len, hidden.values())),
            "n_perturbed_tests": sum(map(len, perturbed.values())),
            "reference_edits": [{"path": path, "old": ref_old, "new": ref_new}],
            "suspect_edits": suspects,
        },
    )


def _suspect_edits(target: Fn, bug: tuple[str, str], buggy: str, fixed: str, path: str) -> list[dict]:
    """The usual suspects: for every other bug `target` is known to have, in the library's order, the
    edit that would fix it were it the injected one, marked `before` when it comes ahead of the
    injected bug in that order. Only those whose old text is not in the buggy file are kept, so
    `edit_file` rejects each of them (what a demonstrator checking the usual suspects runs into)."""
    out, before = [], True
    for family, pairs in target.bugs.items():
        for old, new in pairs:
            if (old, new) == bug:
                before = False
                continue
            other = fixed.replace(target.src, target.src.replace(old, new))
            e_old, e_new = reference_edit(other, fixed)
            if buggy.count(e_old) == 0:
                out.append({"path": path, "old": e_old, "new": e_new, "family": family, "before": before})
    return out


def _fingerprint(task: Task) -> str:
    return hashlib.sha256(repr(sorted(task.files.items())).encode()).hexdigest()


def load(
    split: str | None = None, difficulty: int | None = None, limit: int | None = None, variant: str = ""
) -> list[Task]:
    """Tasks of one split (both when None) and difficulty (all when None); `limit` per
    (split, difficulty). Train skips any task whose files equal an eval task's."""
    themes = parse_themes(variant)
    if difficulty is not None and difficulty not in DIFFICULTIES:
        raise UserError(f"suite synthetic has no difficulty {difficulty}; its difficulties are {list(DIFFICULTIES)}")
    out = []
    for d in [difficulty] if difficulty else DIFFICULTIES:
        n_eval = min(SIZES["eval"], limit or SIZES["eval"])
        evals = [make_task(d, "eval", i, themes) for i in range(SIZES["eval"] if split != "eval" else n_eval)]
        if split in (None, "eval"):
            out += evals[:n_eval]
        if split in (None, "train"):
            seen = {_fingerprint(t) for t in evals}
            n, i = min(SIZES["train"], limit or SIZES["train"]), 0
            while n:
                t = make_task(d, "train", i, themes)
                i += 1
                if _fingerprint(t) not in seen:
                    out.append(t)
                    n -= 1
    return out


def get(task_id: str) -> Task | None:
    """One task by id without generating the suite; None if the id is not one of its tasks."""
    parts = task_id.split("-")
    variant = parts.pop(1) if len(parts) == 5 else ""  # a variant's task: synthetic-THEMES-dN-split-index
    try:
        themes = parse_themes(variant)
    except UserError:  # not a theme list: not an id of this suite (the caller says "no task")
        return None
    if "+".join(themes) != variant:  # not in canonical (sorted) order
        return None
    if len(parts) != 4 or parts[0] != "synthetic" or parts[1] not in ("d1", "d2", "d3") or not parts[3].isdigit():
        return None
    d, split, i = int(parts[1][1]), parts[2], int(parts[3])
    if split not in SIZES or (split == "eval" and i >= SIZES["eval"]):
        return None
    task = make_task(d, split, i, themes)
    if split == "train" and _fingerprint(task) in {
        _fingerprint(make_task(d, "eval", j, themes)) for j in range(SIZES["eval"])
    }:
        return None  # an index skipped because it repeats an eval task
    return task
