"""Bugs injected into a module's functions: every site of each family, as exact text edits.

A bug is one or more edits of a module's source text (character offsets from the standard library's
`ast` positions), so the rest of the file keeps its formatting and the fix is a small diff. Every
site lies inside a function's body (never its decorators, defaults or annotations, which run at
import), and a bug is kept only when the edited module still parses to a different tree. The
families, after SWE-smith's procedural modifiers:

- `comparison`: a comparison operator changed (`<` -> `<=`, `==` -> `!=`, `in` -> `not in`, ...);
- `boolean`: `and` <-> `or`, or a `not` dropped;
- `arithmetic`: an arithmetic operator changed (`+` <-> `-`, `*` <-> `//`, `+=` -> `-=`, ...);
- `off_by_one`: an index, a slice bound or a `range` argument one off (`x[i]` -> `x[i + 1]`);
- `invert_if`: an `if`'s branches swapped (with an `else`) or its condition negated (without);
- `remove_conditional`, `remove_loop`, `remove_assignment`, `remove_return`: the statement deleted
  (`pass` left where the block would be empty);
- `swap_arguments`: a call's first two positional arguments swapped;
- `swap_operands`: the operands of a comparison or a non-commutative operator swapped;
- `wrong_constant`: a literal changed (`True` <-> `False`, an integer plus one);
- `wrong_variable`: a local variable read where another, bound earlier in the function, was meant.

`Bug.function` is the qualified name of the outermost function holding the site (a method counts as
its own function: `Class.method`), the unit that held-out splits are made of; `Bug.code` names the
innermost function (its first line, decorators included, as its code object's `co_firstlineno`),
the code that must run for the bug to matter.
"""

import ast
import functools
from dataclasses import dataclass

FAMILIES = (
    "comparison",
    "boolean",
    "arithmetic",
    "off_by_one",
    "invert_if",
    "remove_conditional",
    "remove_loop",
    "remove_assignment",
    "remove_return",
    "swap_arguments",
    "swap_operands",
    "wrong_constant",
    "wrong_variable",
)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_COMPARE = {
    ast.Lt: ("<", "<="),
    ast.LtE: ("<=", "<"),
    ast.Gt: (">", ">="),
    ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="),
    ast.NotEq: ("!=", "=="),
    ast.In: ("in", "not in"),
    ast.NotIn: ("not in", "in"),
    ast.Is: ("is", "is not"),
    ast.IsNot: ("is not", "is"),
}
_ARITHMETIC = {
    ast.Add: ("+", "-"),
    ast.Sub: ("-", "+"),
    ast.Mult: ("*", "//"),
    ast.FloorDiv: ("//", "*"),
    ast.Div: ("/", "*"),
    ast.Mod: ("%", "//"),
    ast.Pow: ("**", "*"),
    ast.LShift: ("<<", ">>"),
    ast.RShift: (">>", "<<"),
}
_NON_COMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.LShift, ast.RShift)
_ATOMS = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant)


@dataclass(frozen=True)
class Edit:
    start: int  # character offsets into the module's text
    end: int
    new: str


@dataclass(frozen=True)
class Bug:
    path: str  # the module, relative to the repository
    function: str  # qualified name of the outermost function holding the site (the split's unit)
    code: tuple[str, int]  # (name, first line) of the innermost function: whose run makes the bug matter
    family: str
    line: int  # where the site is
    edits: tuple[Edit, ...]

    def apply(self, text: str) -> str:
        for e in sorted(self.edits, key=lambda e: e.start, reverse=True):
            text = text[: e.start] + e.new + text[e.end :]
        return text


def combine(bugs: list[Bug], text: str) -> Bug | None:
    """One bug made of `bugs` (same module) whose edits do not overlap; None when they do, or the
    result does not parse. Its family is "combined"; `function` and `code` are the first bug's."""
    edits = sorted((e for b in bugs for e in b.edits), key=lambda e: e.start)
    if any(a.end > b.start for a, b in zip(edits, edits[1:])):
        return None
    first = bugs[0]
    bug = Bug(first.path, first.function, first.code, "combined", first.line, tuple(edits))
    return bug if _changes_tree(text, bug.apply(text)) else None


def _changes_tree(before: str, after: str) -> bool:
    try:
        return ast.dump(ast.parse(after)) != ast.dump(ast.parse(before))
    except (SyntaxError, ValueError):
        return False


class _Source:
    """A module's text with ast positions (UTF-8 byte columns) turned into character offsets."""

    def __init__(self, text: str):
        self.text = text
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1] if lineno - 1 < len(self.lines) else ""
        return self.starts[lineno - 1] + len(line.encode()[:col].decode(errors="replace"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def segment(self, node: ast.AST) -> str:
        a, b = self.span(node)
        return self.text[a:b]

    def token_between(self, left: ast.AST, right: ast.AST, token: str) -> tuple[int, int] | None:
        """The offsets of `token`, the only thing but blanks and brackets between two nodes."""
        a, b = self.span(left)[1], self.span(right)[0]
        gap = self.text[a:b]
        words = gap.replace("(", " ").replace(")", " ").replace("\\\n", " ").split()
        if words != token.split():
            return None
        i = gap.find(token.split()[0])
        j = gap.rfind(token.split()[-1]) + len(token.split()[-1])
        return a + i, a + j

    def whole_lines(self, first: ast.stmt, last: ast.stmt) -> tuple[int, int] | None:
        """The offsets of the full lines statements `first` .. `last` occupy, when nothing else
        shares them (no `;`, no statement after a colon); None otherwise."""
        a, b = self.span(first)[0], self.span(last)[1]
        line_start = self.starts[first.lineno - 1]
        line_end = self.starts[last.end_lineno] if last.end_lineno < len(self.starts) else len(self.text)
        before, after = self.text[line_start:a], self.text[b:line_end]
        if before.strip() or (after.strip() and not after.strip().startswith("#")):
            return None
        return line_start, line_end

    def indent(self, node: ast.AST) -> str:
        line = self.lines[node.lineno - 1]
        return line[: len(line) - len(line.lstrip())]


def _first_line(fn: ast.AST) -> int:
    return min([fn.lineno, *(d.lineno for d in fn.decorator_list)])


def _body_nodes(fn: ast.AST):
    """Every node of `fn`'s body, not descending into nested functions, classes or lambdas (their
    own sites are found from them)."""
    stack = list(reversed(fn.body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (*_FUNCTIONS, ast.ClassDef, ast.Lambda)):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _functions(tree: ast.Module):
    """(outermost qualified name, function node) of every function, nested ones included."""
    out = []

    def visit(node: ast.AST, prefix: str, outer: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _FUNCTIONS):
                name = f"{prefix}{child.name}"
                out.append((outer or name, child))
                visit(child, f"{name}.<locals>.", outer or name)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", outer)
            elif not isinstance(child, ast.Lambda):
                visit(child, prefix, outer)

    visit(tree, "", None)
    return out


def _parents(fn: ast.AST) -> dict[ast.AST, ast.AST]:
    parents = {}
    for node in _body_nodes(fn):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    for stmt in fn.body:
        parents[stmt] = fn
    return parents


def _block_of(parent: ast.AST, stmt: ast.stmt) -> list[ast.stmt]:
    for name in ("body", "orelse", "finalbody", "handlers"):
        block = getattr(parent, name, None)
        if isinstance(block, list) and stmt in block:
            return block
    return []


def _locals(fn: ast.AST) -> dict[str, int]:
    """The function's local names -> the line where each is first bound (parameters: the def's line)."""
    args = fn.args
    bound = {a.arg: fn.lineno for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    bound.update({a.arg: fn.lineno for a in (args.vararg, args.kwarg) if a is not None})
    for node in _body_nodes(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id not in bound:
            bound[node.id] = node.lineno
    return bound


def _atom(src: _Source, node: ast.AST) -> str:
    text = src.segment(node)
    return text if isinstance(node, _ATOMS) else f"({text})"


def _sites(src: _Source, fn: ast.AST):
    """(family, line, edits) of every site in `fn`'s own body."""
    parents = _parents(fn)
    bound = _locals(fn)
    for node in _body_nodes(fn):
        line = getattr(node, "lineno", fn.lineno)
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            old, new = _COMPARE[type(node.ops[0])]
            at = src.token_between(node.left, node.comparators[0], old)
            if at:
                yield "comparison", line, (Edit(*at, new),)
            left, right = node.left, node.comparators[0]
            if type(node.ops[0]) not in (ast.Eq, ast.NotEq, ast.Is, ast.IsNot) and src.segment(left) != src.segment(
                right
            ):
                yield "swap_operands", line, _swap(src, left, right)
        elif isinstance(node, ast.BoolOp):
            old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            at = src.token_between(node.values[0], node.values[1], old)
            if at:
                yield "boolean", line, (Edit(*at, new),)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            a, b = src.span(node)[0], src.span(node.operand)[0]
            if src.text[a:b].strip() == "not":
                yield "boolean", line, (Edit(a, b, ""),)
        elif isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            old, new = _ARITHMETIC[type(node.op)]
            at = src.token_between(node.left, node.right, old)
            if at:
                yield "arithmetic", line, (Edit(*at, new),)
            if isinstance(node.op, _NON_COMMUTATIVE) and src.segment(node.left) != src.segment(node.right):
                yield "swap_operands", line, _swap(src, node.left, node.right)
        elif isinstance(node, ast.AugAssign) and type(node.op) in _ARITHMETIC:
            old, new = _ARITHMETIC[type(node.op)]
            at = src.token_between(node.target, node.value, old + "=")
            if at:
                yield "arithmetic", line, (Edit(*at, new + "="),)
        elif isinstance(node, ast.Subscript) and not isinstance(node.slice, (ast.Slice, ast.Tuple)):
            yield "off_by_one", line, _one_off(src, node.slice)
        elif isinstance(node, ast.Slice):
            for bound_node in (node.lower, node.upper):
                if bound_node is not None:
                    yield "off_by_one", line, _one_off(src, bound_node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
            if node.args and not isinstance(node.args[-1 if len(node.args) < 3 else 1], ast.Starred):
                yield "off_by_one", line, _one_off(src, node.args[-1 if len(node.args) < 3 else 1])
        if (
            isinstance(node, ast.Call)
            and len(node.args) >= 2
            and not any(isinstance(a, ast.Starred) for a in node.args)
        ):
            first, second = node.args[0], node.args[1]
            if src.segment(first) != src.segment(second):
                yield "swap_arguments", line, _swap(src, first, second)
        if isinstance(node, ast.Constant) and node.lineno == node.end_lineno:
            parent = parents.get(node)
            if isinstance(node.value, bool):
                yield "wrong_constant", line, (Edit(*src.span(node), str(not node.value)),)
            elif (
                type(node.value) is int
                and src.segment(node).isdigit()
                and not isinstance(parent, (ast.Subscript, ast.Slice))
                and not (
                    isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "range"
                )
            ):
                yield "wrong_constant", line, (Edit(*src.span(node), str(node.value + 1)),)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in bound:
            earlier = [(n, at) for n, at in bound.items() if n != node.id and at < node.lineno]
            if earlier:
                other = max(earlier, key=lambda item: (item[1], item[0]))[0]
                yield "wrong_variable", line, (Edit(*src.span(node), other),)
        if isinstance(node, ast.If):
            yield from _if_sites(src, node, parents)
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            removed = _remove(src, node, parents)
            if removed:
                yield "remove_loop", line, removed
        elif isinstance(node, (ast.Assign, ast.AugAssign)) or (isinstance(node, ast.AnnAssign) and node.value):
            removed = _remove(src, node, parents)
            if removed:
                yield "remove_assignment", line, removed
        elif isinstance(node, ast.Return) and node.value is not None:
            removed = _remove(src, node, parents)
            if removed:
                yield "remove_return", line, removed


def _swap(src: _Source, a: ast.AST, b: ast.AST) -> tuple[Edit, ...]:
    return Edit(*src.span(a), src.segment(b)), Edit(*src.span(b), src.segment(a))


def _one_off(src: _Source, node: ast.AST) -> tuple[Edit, ...]:
    if isinstance(node, ast.Constant) and type(node.value) is int and src.segment(node).isdigit():
        return (Edit(*src.span(node), str(node.value + 1 if node.value == 0 else node.value - 1)),)
    a, b = src.span(node)
    return (Edit(a, b, f"{_atom(src, node)} + 1"),)


def _remove(src: _Source, stmt: ast.stmt, parents: dict) -> tuple[Edit, ...] | None:
    """Edits deleting the statement `stmt` whole (a `pass` where its block would be empty)."""
    lines = src.whole_lines(stmt, stmt)
    if lines is None:
        return None
    block = _block_of(parents.get(stmt), stmt)
    alone = len(block) == 1
    return (Edit(*lines, f"{src.indent(stmt)}pass\n" if alone else ""),)


def _if_sites(src: _Source, node: ast.If, parents: dict):
    line = node.lineno
    parent = parents.get(node)
    is_elif = (
        isinstance(parent, ast.If) and parent.orelse == [node] and src.text[src.span(node)[0] :].startswith("elif")
    )
    if node.orelse and not (len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If)):
        body, orelse = src.whole_lines(node.body[0], node.body[-1]), src.whole_lines(node.orelse[0], node.orelse[-1])
        if body and orelse and src.text[body[0] : body[1]] != src.text[orelse[0] : orelse[1]]:
            yield (
                "invert_if",
                line,
                (
                    Edit(*body, src.text[orelse[0] : orelse[1]]),
                    Edit(*orelse, src.text[body[0] : body[1]]),
                ),
            )
    elif not node.orelse:
        a, b = src.span(node.test)
        if isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not):
            negated = src.segment(node.test.operand)
            negated = negated if isinstance(node.test.operand, _ATOMS) else f"({negated})"
        else:
            negated = f"not {_atom(src, node.test)}"
        yield "invert_if", line, (Edit(a, b, negated),)
        if not is_elif:
            removed = _remove(src, node, parents)
            if removed:
                yield "remove_conditional", line, removed


def bugs(path: str, text: str) -> list[Bug]:
    """Every bug of every family in the functions of the module `path` (its source `text`), in the
    order of the source; [] when it does not parse. Whether each one still parses is `sound`'s to
    say (a parse of the whole module: done only for the bugs that are tried)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    src = _Source(text)
    out, seen = [], set()
    for outer, fn in _functions(tree):
        code = (fn.name, _first_line(fn))
        for family, line, edits in _sites(src, fn):
            bug = Bug(path, outer, code, family, line, tuple(sorted(edits, key=lambda e: e.start)))
            key = (bug.edits, family)
            if key in seen:
                continue
            seen.add(key)
            out.append(bug)
    return out


def function_lines(text: str) -> dict[str, int]:
    """Qualified name of each outermost function (methods included) -> its number of lines."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return {}
    out: dict[str, int] = {}
    for outer, fn in _functions(tree):  # an outermost function comes before the functions inside it
        out.setdefault(outer, fn.end_lineno - _first_line(fn) + 1)
    return out


def sound(bug: Bug, text: str) -> bool:
    """Whether `bug` applied to the module `text` parses, to a different tree (a swap of equal
    operands or a rewrite the parser reads the same is no bug). Only the top-level statements it
    edits are parsed again: a whole module of thousands of lines takes a tenth of a second."""
    spans = _top_level(text)
    touched = sorted({next(s for s in spans if s[0] <= e.start and e.end <= s[1]) for e in bug.edits})
    for a, b in touched:
        local = Bug(
            bug.path,
            bug.function,
            bug.code,
            bug.family,
            bug.line,
            tuple(Edit(e.start - a, e.end - a, e.new) for e in bug.edits if a <= e.start and e.end <= b),
        )
        if not _changes_tree(text[a:b], local.apply(text[a:b])):
            return False
    return True


@functools.lru_cache(maxsize=8)
def _top_level(text: str) -> list[tuple[int, int]]:
    """The character spans of the module's top-level statements, whole lines (decorators included)."""
    src = _Source(text)
    spans = []
    for node in ast.parse(text).body:
        first = _first_line(node) if isinstance(node, (*_FUNCTIONS, ast.ClassDef)) else node.lineno
        end = src.starts[node.end_lineno] if node.end_lineno < len(src.starts) else len(text)
        spans.append((src.starts[first - 1], end))
    return spans
