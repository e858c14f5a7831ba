"""The tool `outline`: the functions and classes of the repository's Python files, with their lines.

A Python-callable tool: strop calls `outline(sandbox, arguments, limit)` in the rollout worker's
process, once per call the policy makes, with that episode's sandbox; the files are read through
the sandbox (never the host's), and the text returned is the observation the policy reads."""

import ast

from strop.env.harness.tools import Tool, ToolError


def outline(sandbox, arguments: dict, limit: int) -> str:
    path = arguments.get("path", ".")
    if path.endswith(".py"):
        files = [path]
    else:
        found = sandbox.exec(["find", path, "-name", "*.py", "-not", "-path", "*/.*"], timeout=10)
        if found.exit_code != 0:
            raise ToolError(found.stderr.strip() or f"cannot list {path}")
        files = sorted(p.removeprefix("./") for p in found.stdout.split())
    lines = []
    for name in files:
        try:
            tree = ast.parse(sandbox.read_file(name))
        except FileNotFoundError:
            raise ToolError(f"no such file: {name}") from None
        except SyntaxError as e:
            lines.append(f"{name}: does not parse (line {e.lineno})")
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "def"
                lines.append(f"{name}:{node.lineno} {kind} {node.name}")
    return "\n".join(lines) or "no functions or classes"


OUTLINE = Tool(
    name="outline",
    description="List the functions and classes of the Python files, with their lines.",
    parameters={"type": "object", "properties": {"path": {"type": "string"}}},
    role="read",
    function=outline,
)
