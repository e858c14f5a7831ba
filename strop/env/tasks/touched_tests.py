"""The tests a diff touches: the pytest node ids of the test functions, methods and classes whose
lines a unified diff adds or changes, read from the test modules as they are after it.

The miner's cheaper scope (`strop tasks mine --tests touched`): a real project's test module can
hold hundreds of tests taking tens of seconds, while a commit's tests are a handful. What pytest
collects is read the way pytest does by default: module-level functions named `test*`; in classes
named `Test*` or deriving from a `...TestCase`, methods named `test*`. A change inside such a class
but outside its test methods (a fixture, a helper) selects the whole class; a change outside any
test (imports, helpers) selects nothing by itself. A module in which nothing is selected, or that
does not parse, is selected whole.
"""

import ast
import re

_HUNK = re.compile(r"@@ -\d+(?:,\d+)? \+(\d+)")
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def changed_lines(patch: str) -> dict[str, set[int]]:
    """Path -> the line numbers, after the patch, that it adds or changes (a deletion marks the line
    that follows it). Paths git quotes (unusual characters) are left out."""
    out: dict[str, set[int]] = {}
    path, line = None, 0
    for text in patch.splitlines():
        if text.startswith("diff --git "):
            path = None
        elif text.startswith("+++ "):
            path = text[6:] if text.startswith("+++ b/") else None
            if path is not None:
                out.setdefault(path, set())
        elif path is None:
            continue
        elif text.startswith("@@"):
            found = _HUNK.match(text)
            line = int(found.group(1)) if found else 0
        elif text.startswith("+"):
            out[path].add(line)
            line += 1
        elif text.startswith("-"):
            out[path].add(line)
        elif text.startswith(" "):
            line += 1
    return out


def _span(node: ast.AST) -> set[int]:
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return set(range(first, node.end_lineno + 1))


def _collected_class(node: ast.ClassDef) -> bool:
    bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in node.bases]
    return node.name.startswith("Test") or any(b.endswith("TestCase") for b in bases)


def touched(path: str, source: str, lines: set[int]) -> list[str]:
    """Node ids of the tests of module `path` (its text `source`) that `lines` touch; [path] when
    none is, or the module does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return [path]
    ids = []
    for node in tree.body:
        if not lines & _span(node):
            continue
        if isinstance(node, _FUNCTIONS) and node.name.startswith("test"):
            ids.append(f"{path}::{node.name}")
        elif isinstance(node, ast.ClassDef) and _collected_class(node):
            methods = [m for m in node.body if isinstance(m, _FUNCTIONS) and m.name.startswith("test")]
            hit = [m for m in methods if lines & _span(m)]
            ids += [f"{path}::{node.name}::{m.name}" for m in hit] or [f"{path}::{node.name}"]
    return ids or [path]


def touched_tests(patch: str, modules: dict[str, str]) -> list[str]:
    """The node ids `patch` touches in `modules` (path -> text after the patch), sorted."""
    lines = changed_lines(patch)
    return sorted(t for path, text in modules.items() for t in touched(path, text, lines.get(path, set())))
