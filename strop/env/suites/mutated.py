"""The `mutated` suite: real bugs in real code. AST mutants of pure-Python packages whose
installed distributions ship their own tests, kept only when the checker sees at least one of
those tests fail, each turned into a "make the tests pass" task.

Build (slow, once): `strop tasks build --suite mutated` copies each source package (plus the
pure-Python dependencies it needs, vendored into the repository, since the sandbox exposes
only pytest) out of the installed site-packages, runs every test file on the pristine copy in
the sandbox (keeping those that pass fully and quickly), enumerates mutation sites in functions
named by some kept test file, and verifies mutants through `checker.check` (in parallel) in a
seeded order, round-robin over packages, at most `PER_FUNCTION` tried per function. The cache holds one base
repository per package (`mutated-bases.json`) and one JSON line per task with only its
mutated file (`mutated.jsonl`, streamed to `mutated.jsonl.partial` while building), under
`$STROP_CACHE/suites` (default `~/.cache/strop/suites`).
The split is by function (hash of package, module, function): eval bugs sit in functions
that train never mutates.
"""

import ast
import hashlib
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from random import Random

from strop.env.runner import is_test_module, is_test_path
from strop.env.task import Task
from strop.env.world.patches import reference_edit
from strop.errors import UserError

# package -> the pure-Python distributions vendored next to it
PACKAGES: dict[str, tuple[str, ...]] = {"toolz": (), "fire": ("termcolor",), "mpmath": ()}
SKIP_TESTS = ("_fuzz_test.py", "test_referencing_suite.py", "torture.py", "runtests.py", "extratest_")
PER_FUNCTION = 3
TEST_TIMEOUT_S = 30.0  # a task's test run; baseline files slower than BASELINE_MAX_S are not used
BASELINE_MAX_S = 15.0
EVAL_FRACTION = 0.2

CMP_FLIP = {
    ast.Lt: "<=",
    ast.LtE: "<",
    ast.Gt: ">=",
    ast.GtE: ">",
    ast.Eq: "!=",
    ast.NotEq: "==",
    ast.In: "not in",
    ast.NotIn: "in",
    ast.Is: "is not",
    ast.IsNot: "is",
}
CMP_TEXT = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Is: "is",
    ast.IsNot: "is not",
}
BIN_SWAP = {
    ast.Add: ("+", "-"),
    ast.Sub: ("-", "+"),
    ast.Mult: ("*", "//"),
    ast.FloorDiv: ("//", "*"),
    ast.Div: ("/", "*"),
    ast.Mod: ("%", "//"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("STROP_CACHE", "~/.cache/strop")).expanduser() / "suites"


@dataclass(frozen=True)
class Mutation:
    path: str
    function: str
    family: str
    start: int  # byte offsets into the file
    end: int
    new: str

    def apply(self, text: str) -> str:
        b = text.encode()
        return (b[: self.start] + self.new.encode() + b[self.end :]).decode()


def _offsets(src: bytes) -> list[int]:
    starts, pos = [0], 0
    for line in src.splitlines(keepends=True):
        pos += len(line)
        starts.append(pos)
    return starts


def mutations(path: str, text: str) -> list[Mutation]:
    """Every single-token mutation inside the functions of one module."""
    src = text.encode()
    line_at = _offsets(src)
    tree = ast.parse(text)

    def off(lineno: int, col: int) -> int:
        return line_at[lineno - 1] + col

    out: list[Mutation] = []

    def between(node_a, node_b, token: str, new: str, fn: str, family: str) -> None:
        a, b = off(node_a.end_lineno, node_a.end_col_offset), off(node_b.lineno, node_b.col_offset)
        gap = src[a:b].decode()
        if gap.count(token) == 1 and gap.replace(token, "").strip(" ()\n\\") == "":
            i = a + len(gap[: gap.index(token)].encode())
            out.append(Mutation(path, fn, family, i, i + len(token.encode()), new))

    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        for node in [n for stmt in fn.body for n in ast.walk(stmt)]:
            if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in CMP_FLIP:
                op = type(node.ops[0])
                between(node.left, node.comparators[0], CMP_TEXT[op], CMP_FLIP[op], fn.name, "comparison_flip")
            elif isinstance(node, ast.BinOp) and type(node.op) in BIN_SWAP:
                old, new = BIN_SWAP[type(node.op)]
                between(node.left, node.right, old, new, fn.name, "wrong_operator")
            elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
                old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
                between(node.values[0], node.values[1], old, new, fn.name, "wrong_operator")
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                out.append(
                    Mutation(
                        path,
                        fn.name,
                        "missing_case",
                        off(node.lineno, node.col_offset),
                        off(node.operand.lineno, node.operand.col_offset),
                        "",
                    )
                )
            elif isinstance(node, ast.Constant) and type(node.value) in (int, bool) and node.lineno == node.end_lineno:
                a, b = off(node.lineno, node.col_offset), off(node.end_lineno, node.end_col_offset)
                if type(node.value) is bool:
                    out.append(Mutation(path, fn.name, "wrong_constant", a, b, str(not node.value)))
                elif src[a:b].decode().isdigit():  # plain decimal literals only
                    out.append(Mutation(path, fn.name, "off_by_one", a, b, str(node.value + 1)))
    return out


def _package_files(name: str) -> dict[str, str]:
    root = next(Path(p) for p in sys.path if (Path(p) / name / "__init__.py").is_file())
    files = {}
    for f in sorted((root / name).rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts and f.suffix in (".py", ".typed", ".md", ".txt", ".json"):
            files[str(f.relative_to(root))] = f.read_text()
    return files


def _split_of(pkg: str, path: str, function: str) -> str:
    h = int(hashlib.sha256(f"{pkg}/{path}/{function}".encode()).hexdigest()[:8], 16)
    return "eval" if h % 1000 < EVAL_FRACTION * 1000 else "train"


def _task(pkg: str, base: dict[str, str], index: int, m: Mutation | None, tests: list[str], n_tests: int) -> Task:
    files = dict(base)
    meta = {"source": pkg, "timeout_s": TEST_TIMEOUT_S, "n_tests": n_tests}
    if m is not None:
        files[m.path] = m.apply(base[m.path])
        old, new = reference_edit(files[m.path], base[m.path])
        lines = base[m.path].count("\n")
        meta.update(
            family=m.family,
            function=m.function,
            path=m.path,
            difficulty=1 if lines < 300 else 2 if lines < 1000 else 3,
            reference_edits=[{"path": m.path, "old": old, "new": new}],
        )
    shown = ", ".join(f"`{t}`" for t in tests)
    return Task(
        id=f"mutated-{pkg}-{index:04d}",
        suite="mutated",
        split=_split_of(pkg, m.path, m.function) if m else "eval",
        instruction=(
            f"After a recent change, tests in {shown} fail. Find the bug in the `{pkg}` source code "
            "(not in the tests) and fix it so that the tests pass."
        ),
        files=files,
        hidden_tests={t: base[t] for t in tests},
        metadata=meta,
    )


def _candidates(bases: dict, baseline: dict, queues: dict) -> list[tuple[str, Mutation, list[str]]]:
    """(package, mutation, test files) in verification order: round-robin over packages, at most
    PER_FUNCTION per function, each with the smallest passing test file that names the function."""
    out, per_fn, named = [], {}, {}
    while any(queues.values()):
        for pkg, queue in queues.items():
            if not queue:
                continue
            m = queue.pop()
            if (pkg, m.function) not in named:  # a regex scan of every test file: once per function
                word = re.compile(rf"\b{re.escape(m.function)}\b")
                named[pkg, m.function] = sorted(
                    (t for t in baseline[pkg] if word.search(bases[pkg][t])), key=lambda t: len(bases[pkg][t])
                )[:1]
            tests = named[pkg, m.function]
            if per_fn.get((m.path, m.function), 0) < PER_FUNCTION and tests and not m.function.startswith("__"):
                per_fn[(m.path, m.function)] = per_fn.get((m.path, m.function), 0) + 1
                out.append((pkg, m, tests))
    return out


def build(
    out_dir: Path | None = None,
    target: int = 240,
    packages: tuple[str, ...] | None = None,
    seed: int = 0,
    workers: int = 2,
    log=print,
) -> Path:
    """Build and cache the suite; returns the cache directory. Progress goes to `log`."""
    from strop.env.grading.checker import check  # the build runs the checker; loading the suite does not

    out_dir = out_dir or cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = Random(seed)
    bases, queues, baseline = {}, {}, {}
    for pkg in packages or tuple(PACKAGES):
        base = _package_files(pkg)
        for dep in PACKAGES.get(pkg, ()):
            base.update(_package_files(dep))
        bases[pkg] = base
        files = [
            p for p in base if p.startswith(pkg + "/") and is_test_module(p) and not any(s in p for s in SKIP_TESTS)
        ]
        with ThreadPoolExecutor(workers) as pool:
            scores = pool.map(lambda t: check(_task(pkg, base, 0, None, [t], 0), {}, perturbed=False), files)
            kept = {
                t: s.passed
                for t, s in zip(files, scores)
                if s.reward == 1.0 and s.skipped == 0 and s.duration < BASELINE_MAX_S
            }
        baseline[pkg] = kept
        log(f"mutated: {pkg}: {len(kept)} test files pass on the pristine copy")
        sites = [
            m
            for p, text in base.items()
            if p.startswith(pkg + "/") and p.endswith(".py") and not is_test_path(p)
            for m in mutations(p, text)
        ]
        rng.shuffle(sites)
        queues[pkg] = sites
    with open(out_dir / "mutated-bases.json", "w") as f:
        json.dump(bases, f)
    candidates = _candidates(bases, baseline, queues)
    partial = out_dir / "mutated.jsonl.partial"  # streamed, so an interrupted build keeps its work
    tasks, tried = [], 0
    with open(partial, "w") as out, ThreadPoolExecutor(workers) as pool:
        while len(tasks) < target and tried < len(candidates):
            batch = candidates[tried : tried + 4 * workers]  # verified in parallel, kept in candidate order
            tried += len(batch)
            for (pkg, m, tests), score in zip(
                batch, pool.map(lambda c: check(_task(c[0], bases[c[0]], 0, c[1], c[2], 0), {}, perturbed=False), batch)
            ):
                if (
                    len(tasks) < target
                    and score.reward == 0.0
                    and (score.failed or score.errors)
                    and score.outcome == "tests failed"
                ):
                    task = _task(pkg, bases[pkg], len(tasks), m, tests, sum(baseline[pkg][t] for t in tests))
                    tasks.append(task)
                    d = task.to_dict()
                    d["files"] = {m.path: task.files[m.path]}  # the rest is the package base
                    out.write(json.dumps(d) + "\n")
                    out.flush()
                    log(
                        f"mutated: {len(tasks)}/{target} kept ({tried} tried): "
                        f"{task.id} {m.family} in {m.path}:{m.function}"
                    )
    partial.rename(out_dir / "mutated.jsonl")
    log(
        f"mutated: wrote {len(tasks)} tasks from {len({t.metadata['source'] for t in tasks})} packages "
        f"({tried} mutants tried) to {out_dir}"
    )
    return out_dir


def load(split: str | None = None, cache: Path | str | None = None) -> list[Task]:
    d = Path(cache) if cache else cache_dir()
    if not (d / "mutated.jsonl").is_file():
        raise UserError(f"the mutated suite is not built in {d}; run `strop tasks build --suite mutated`")
    bases = json.loads((d / "mutated-bases.json").read_text())
    tasks = []
    for line in (d / "mutated.jsonl").read_text().splitlines():
        t = Task.from_dict(json.loads(line))
        t.files = {**bases[t.metadata["source"]], **t.files}
        if split in (None, t.split):
            tasks.append(t)
    return tasks
