"""Tools as plugins: what a tool is, how a tool set is declared, and how one call is executed.

A `Tool` is a name, a description, the JSON Schema of its arguments, a role and an implementation:

- a Python function `function(sandbox, arguments, limit) -> str | ToolResult`, given the episode's
  sandbox (`strop.env.sandbox.interface.Sandbox`), the checked arguments and the observation limit in chars;
  it raises `ToolError("why")` for a call the model got wrong (the observation reads "error: why");
- or a `command` template run in the sandbox under bash, each `{argument}` replaced by the
  argument shell-quoted (an absent optional one by its schema `default`, else ''); the observation
  is "exit code N" and the output.

The role (`ROLES`: read, edit, run, search, submit, other) is what the rest of strop reads: the hack
monitor, the behaviour statistics, the online monitors and probes never read tool names, so a tool
set may rename or replace the built-ins. A call of a `submit` tool ends the episode.

A tool set is declared by a list of specs (`[harness] tools`, `load_tools`), each one of:
- a name in the entry point group `strop.tools` (strop registers its built-in coding tools there,
  one by one and as the set `coding`, exactly as an environment package registers its own);
- a dotted Python path, `package.module:attribute` or `package.module.attribute`;
- a `.toml` or `.json` file of command tools (`[[tool]]` tables: name, description, role,
  parameters, command, timeout_s);
- `new=spec`: the one tool `spec` names, renamed `new`.
An entry point or attribute holds a `Tool` or a list of them.

`ToolSet.execute` never raises for anything the model can write: unknown tools, arguments that do
not fit the schema, and `ToolError`s come back as a `ToolResult` whose `error` says what was wrong.
"""

import json
import re
import shlex
import string
import tomllib
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable, Literal

from strop.config import HarnessSection
from strop.env.plugins import load_object
from strop.env.sandbox.interface import Sandbox
from strop.errors import UserError

GROUP = "strop.tools"  # the entry point group tools register under
DEFAULT_TOOLS = tuple(HarnessSection().tools)  # strop's built-in coding tools (`[harness] tools`)
ROLES = ("read", "edit", "run", "search", "submit", "other")
Role = Literal["read", "edit", "run", "search", "submit", "other"]
RUN_TIMEOUT_S = 30.0  # default wall-clock limit of a command tool
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what the OpenAI API accepts as a function name
_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}
_A = {"integer": "an integer", "array": "an array", "object": "an object"}  # the rest take "a"


class ToolError(Exception):
    """Raised by a tool function for a call the model got wrong: its message is the observation."""


@dataclass
class ToolResult:
    output: str  # the observation the model reads
    error: str | None = None  # why the call was rejected or failed; None on success
    submitted: bool = False


def error(message: str) -> ToolResult:
    return ToolResult(f"error: {message}", error=message)


ToolFunction = Callable[[Sandbox, dict, int], "str | ToolResult"]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON Schema of the arguments: an object
    role: Role = "other"
    function: ToolFunction | None = None
    command: str | None = None  # a bash command template with {argument} fields
    timeout_s: float = RUN_TIMEOUT_S  # wall-clock limit of a command tool

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem:
            raise UserError(f"tool {self.name!r}: {problem}")

    def _problem(self) -> str | None:
        if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
            return "a tool name is 1-64 letters, digits, '_' or '-'"
        if self.role not in ROLES:
            return f"role {self.role!r} is not one of {', '.join(ROLES)}"
        if (self.function is None) == (self.command is None):
            return "needs exactly one implementation: a function or a command"
        if self.function is not None and not callable(self.function):
            return f"function {self.function!r} is not callable"
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            return f"timeout_s must be a positive number, got {self.timeout_s!r}"
        problem = schema_problem(self.parameters)
        if problem:
            return f"parameters are not a JSON Schema of an object: {problem}"
        if self.command is not None:
            fields = command_fields(self.command)
            if isinstance(fields, str):
                return fields
            unknown = sorted(set(fields) - set(self.parameters.get("properties", {})))
            if unknown:
                return f"command field {{{unknown[0]}}} is not one of its parameters"
        return None

    def schema(self) -> dict:
        """The OpenAI function-calling schema the model is shown."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def schema_problem(parameters) -> str | None:
    """Why `parameters` is not a JSON Schema of an object (with a `properties` table), or None."""
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for

    if not isinstance(parameters, dict):
        return f"expected a table, got {type(parameters).__name__}"
    if parameters.get("type") != "object":
        return f'"type" must be "object", got {parameters.get("type")!r}'
    if not isinstance(parameters.get("properties", {}), dict):
        return '"properties" must be a table'
    try:
        validator_for(parameters).check_schema(parameters)
    except SchemaError as e:
        return f"{e.message} (at {'/'.join(map(str, e.absolute_path)) or 'the top'})"
    return None


def command_fields(command) -> list[str] | str:
    """The {argument} fields of a command template, or why it is not one."""
    if not isinstance(command, str) or not command.strip():
        return "command must be a non-empty string"
    try:
        parsed = list(string.Formatter().parse(command))
    except ValueError as e:
        return f"command template {command!r}: {e} (write {{{{ and }}}} for literal braces)"
    fields = []
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not NAME.fullmatch(name) or spec or conversion:
            return f"command field {{{name}...}} must be a bare argument name, without ! or :"
        fields.append(name)
    return fields


def clip(text: str, limit: int) -> str:
    """`text` if it fits in `limit` chars, else its head and tail around a cut marker."""
    if len(text) <= limit:
        return text
    keep = max(limit - 40, 0)
    head, tail = text[: keep // 2], text[len(text) - (keep - keep // 2) :] if keep else ""
    return f"{head}\n[... {len(text) - len(head) - len(tail)} chars cut ...]\n{tail}"


def _shell_word(value) -> str:
    return shlex.quote(value if isinstance(value, str) else json.dumps(value))


def _run_command(tool: Tool, sandbox: Sandbox, arguments: dict, limit: int) -> ToolResult:
    props = tool.parameters.get("properties", {})
    values = {k: _shell_word(arguments.get(k, props[k].get("default", ""))) for k in command_fields(tool.command)}
    result = sandbox.exec(tool.command.format(**values), timeout=tool.timeout_s)
    out = result.stdout + (("\n" if result.stdout and not result.stdout.endswith("\n") else "") + result.stderr)
    if result.timed_out:
        return error(f"{tool.name} timed out after {tool.timeout_s:g} s")
    return ToolResult(f"exit code {result.exit_code}\n{clip(out.rstrip(), limit)}".rstrip())


class ToolSet:
    """The tools one harness offers, by name, with their roles and argument validators."""

    def __init__(self, tools: Iterable[Tool]):
        from jsonschema.validators import validator_for

        self.tools = tuple(tools)
        names = [t.name for t in self.tools]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup:
            raise UserError(f"tool set declares {dup!r} twice (rename one: new_name=spec)")
        self._by_name = {t.name: t for t in self.tools}
        self._validators = {t.name: validator_for(t.parameters)(t.parameters) for t in self.tools}

    def __iter__(self):
        return iter(self.tools)

    def __len__(self) -> int:
        return len(self.tools)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tools]

    def schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools]

    def role(self, name: str) -> str | None:
        """The role of tool `name`; None when the set has no such tool."""
        tool = self._by_name.get(name)
        return tool.role if tool else None

    def roles(self) -> dict[str, str]:
        return {t.name: t.role for t in self.tools}

    def of_role(self, role: str) -> list[Tool]:
        return [t for t in self.tools if t.role == role]

    def log(self, name: str, arguments: dict | str, result: ToolResult) -> dict:
        """The record of one executed call that the hack monitor and behaviour statistics read."""
        return {
            "name": name,
            "role": self.role(name),
            "arguments": arguments,
            "output": result.output,
            "error": result.error,
        }

    def check_arguments(self, name: str, arguments: dict) -> str | None:
        """Why `arguments` do not fit the schema of tool `name`, or None."""
        params = self._by_name[name].parameters
        props = params.get("properties", {})
        missing = [k for k in params.get("required", []) if k not in arguments]
        if missing:
            return f"{name} needs argument(s) {', '.join(missing)}"
        for key, value in arguments.items():
            spec = props.get(key)
            if spec is None:
                if params.get("additionalProperties"):
                    continue
                return f"{name} has no argument {key!r} (arguments: {', '.join(props) or 'none'})"
            want = spec.get("type") if isinstance(spec, dict) else None
            if isinstance(want, str) and want in _TYPES:
                if not isinstance(value, _TYPES[want]) or (isinstance(value, bool) and want != "boolean"):
                    return f"argument {key!r} of {name} must be {_A.get(want, 'a ' + want)}"
            if isinstance(value, str) and "\x00" in value:
                return f"argument {key!r} contains a NUL character"
        problem = next(iter(self._validators[name].iter_errors(arguments)), None)
        return f"arguments of {name}: {problem.message[:200]}" if problem else None

    def execute(self, sandbox: Sandbox, name: str, arguments: dict | str, limit: int = 2000) -> ToolResult:
        """Run one tool call; `limit` caps the observation (chars, plus a short note)."""
        tool = self._by_name.get(name)
        if tool is None:
            return error(f"unknown tool {name!r} (tools: {', '.join(self.names)})")
        if not isinstance(arguments, dict):
            return error(f"arguments of {name} must be a JSON object")
        problem = self.check_arguments(name, arguments)
        if problem:
            return error(problem)
        if tool.command is not None:
            result = _run_command(tool, sandbox, arguments, limit)
        else:
            try:
                out = tool.function(sandbox, arguments, limit)
            except ToolError as e:
                return error(str(e))
            result = out if isinstance(out, ToolResult) else ToolResult(clip(str(out), limit))
        if tool.role == "submit" and result.error is None:
            result.submitted = True
        return result


def list_tools() -> list[str]:
    """Names registered under the `strop.tools` entry point group."""
    return sorted({ep.name for ep in metadata.entry_points(group=GROUP)})


def _tools_file(path: Path) -> list[Tool]:
    """The command tools of a .toml (`[[tool]]` tables) or .json (a list of objects) file."""
    try:
        text = path.read_text(encoding="utf-8")
        data = tomllib.loads(text).get("tool", []) if path.suffix == ".toml" else json.loads(text)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"tool file {str(path)!r} cannot be read: {e}") from None
    if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
        raise UserError(f"tool file {str(path)!r} must hold a list of tool tables ([[tool]] in TOML)")
    known = {"name", "description", "parameters", "role", "command", "timeout_s"}
    tools = []
    for i, d in enumerate(data):
        extra = sorted(set(d) - known)
        if extra:
            raise UserError(f"tool file {str(path)!r}, tool {i + 1}: unknown key {extra[0]!r} (known: {sorted(known)})")
        if "command" not in d:
            raise UserError(f"tool file {str(path)!r}, tool {i + 1}: a file declares command tools; needs 'command'")
        params = d.get("parameters", {"type": "object", "properties": {}})
        tools.append(Tool(d.get("name", ""), d.get("description", ""), params, d.get("role", "other"), **_impl(d)))
    return tools


def _impl(d: dict) -> dict:
    return {"command": d["command"]} | ({"timeout_s": d["timeout_s"]} if "timeout_s" in d else {})


def _load_spec(spec: str) -> list[Tool]:
    new, eq, rest = spec.partition("=")
    if eq and NAME.fullmatch(new.strip()):
        tools = _load_spec(rest.strip())
        if len(tools) != 1:
            raise UserError(f"tool spec {spec!r}: {rest.strip()!r} is a set of {len(tools)} tools; rename one by one")
        return [replace(tools[0], name=new.strip())]
    if spec.endswith((".toml", ".json")):
        path = Path(spec)
        if not path.is_file():
            raise UserError(f"tool file {spec!r} does not exist")
        return _tools_file(path)
    found = load_object(GROUP, spec, "tool")
    if found is None:
        raise UserError(
            f"unknown tool {spec!r}: not a `strop.tools` entry point ({', '.join(list_tools()) or 'none installed'}), "
            "a dotted path package.module:attribute, or a .toml/.json tool file"
        )
    items = list(found) if isinstance(found, (list, tuple)) else [found]
    bad = next((x for x in items if not isinstance(x, Tool)), None)
    if bad is not None or not items:
        raise UserError(f"tool spec {spec!r} names {bad!r}, not a strop.env.harness.tools.Tool or a list of them")
    return items


def load_tools(specs: Iterable[str] = DEFAULT_TOOLS) -> ToolSet:
    """The tool set the specs declare, in order (see the module docstring)."""
    specs = list(specs)
    if not specs:
        raise UserError("the tool set is empty: declare at least one tool (default: harness.tools = ['coding'])")
    return ToolSet(t for spec in specs for t in _load_spec(spec))


def describe_call(name: str, arguments: dict | str) -> str:
    """One short line for progress output: `run: pytest -q`."""
    if isinstance(arguments, dict):
        main = arguments.get("command") or arguments.get("pattern") or arguments.get("path") or ""
        return f"{name}: {main}"[:120]
    return f"{name}: {arguments[:80]!r}"
