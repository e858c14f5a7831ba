"""Tools as plugins: a tool set declared by entry points, dotted paths and command files, renamed
by a config; custom tools executed in a real sandbox; the behaviour statistics read roles, not
names; bad declarations are one line and exit 2."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from strop.env.demonstrators.runs import DEMONSTRATION_HARNESS
from strop.env.demonstrators.scripted import ScriptedClient
from strop.env.grading.behaviour import episode_stats
from strop.env.harness.loop import Harness, harness_config
from strop.env.harness.tools import Tool, ToolError, ToolSet, load_tools
from strop.env.sandbox.backend import open_sandbox
from strop.env.sandbox.interface import Limits
from strop.errors import UserError


def _symbols(sandbox, arguments: dict, limit: int) -> str:
    """A Python-callable tool: the top-level functions of a file, read through the sandbox."""
    import ast

    try:
        source = sandbox.read_file(arguments["path"]).decode()
    except FileNotFoundError:
        raise ToolError(f"no such file: {arguments['path']}") from None
    return "\n".join(f"{n.name} (line {n.lineno})" for n in ast.parse(source).body if isinstance(n, ast.FunctionDef))


SYMBOLS = Tool(
    "symbols",
    "List the functions of a Python file.",
    {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    "read",
    function=_symbols,
)
RENAMED = ["view=read_file", "patch=edit_file", "create=write_file", "ls=list_dir", "search=grep", "shell=run"]


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture
def sandbox(tmp_path):
    (tmp_path / "mod.py").write_text("def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n")
    (tmp_path / "test_mod.py").write_text("from mod import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n")
    sb = open_sandbox(tmp_path, Limits(timeout_s=10))
    yield sb
    sb.close()


def test_the_builtins_are_entry_points_with_roles():
    tools = load_tools()
    assert tools.names == ["read_file", "edit_file", "write_file", "list_dir", "grep", "run", "submit"]
    assert tools.roles() == {
        "read_file": "read",
        "edit_file": "edit",
        "write_file": "edit",
        "list_dir": "search",
        "grep": "search",
        "run": "run",
        "submit": "submit",
    }
    assert load_tools(["grep", "view=read_file"]).names == ["grep", "view"]


def test_command_and_python_tools_run_in_the_sandbox(tmp_path, sandbox):
    spec = tmp_path / "tools.toml"
    spec.write_text(
        '[[tool]]\nname = "count_lines"\ndescription = "Count the lines of a file."\nrole = "read"\n'
        'command = "wc -l < {path}"\n'
        'parameters = {type = "object", properties = {path = {type = "string"}}, required = ["path"]}\n'
    )
    tools = load_tools(["coding", str(spec), "tests.test_tool_plugins:SYMBOLS"])
    assert tools.execute(sandbox, "count_lines", {"path": "mod.py"}).output == "exit code 0\n6"
    # the argument is one shell word: no injection through it
    assert tools.execute(sandbox, "count_lines", {"path": "mod.py; echo pwned"}).output.startswith("exit code 1")
    assert tools.execute(sandbox, "symbols", {"path": "mod.py"}).output == "add (line 1)\nsub (line 5)"
    missing = tools.execute(sandbox, "symbols", {"path": "nope.py"})
    assert missing.error == "no such file: nope.py" and missing.output == "error: no such file: nope.py"
    assert "needs argument(s) path" in tools.execute(sandbox, "symbols", {}).error
    assert "must be a string" in tools.execute(sandbox, "symbols", {"path": 3}).error
    assert "unknown tool 'nope'" in tools.execute(sandbox, "nope", {}).error


def test_schema_constraints_beyond_types_are_checked(sandbox):
    tool = Tool(
        "pick",
        "Pick a mode.",
        {"type": "object", "properties": {"mode": {"type": "string", "enum": ["fast", "slow"]}}},
        command="echo {mode}",
    )
    tools = ToolSet([tool])  # a tool set built from Tool objects directly
    assert tools.execute(sandbox, "pick", {"mode": "fast"}).output == "exit code 0\nfast"
    assert "is not one of ['fast', 'slow']" in tools.execute(sandbox, "pick", {"mode": "quick"}).error


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: load_tools(["no_such_tool"]), "unknown tool 'no_such_tool'"),
        (lambda: load_tools(["tests.test_tool_plugins:NOPE"]), "has no 'NOPE'"),
        (lambda: load_tools(["no_such_module.tools:X"]), "cannot be imported"),
        (lambda: load_tools(["view=coding"]), "rename one by one"),
        (lambda: load_tools(["coding", "read_file"]), "declares 'read_file' twice"),
        (
            lambda: Tool("t", "d", {"type": "object", "properties": {"a": {"type": "strin"}}}, command="echo"),
            "not a JSON Schema",
        ),
        (lambda: Tool("t", "d", {"type": "array"}, command="echo"), '"type" must be "object"'),
        (lambda: Tool("t", "d", {"type": "object"}, command="cat {path}"), "command field {path}"),
        (lambda: Tool("t", "d", {"type": "object"}, role="write"), "role 'write'"),
        (lambda: Tool("t", "d", {"type": "object"}), "exactly one implementation"),
        (lambda: Tool("bad name", "d", {"type": "object"}, command="echo"), "tool name"),
    ],
)
def test_bad_declarations_are_user_errors(make, needle):
    with pytest.raises(UserError) as e:
        make()
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_bad_tool_set_in_a_config_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "bad.toml").write_text('[harness]\ntools = ["coding", "not_installed_anywhere"]\n')
    (tmp_path / "schema.toml").write_text('[harness]\ntools = ["coding", "t.toml"]\n')
    (tmp_path / "t.toml").write_text(
        '[[tool]]\nname = "t"\ndescription = "d"\ncommand = "echo"\nparameters = {type = "object", required = 3}\n'
    )
    for config, needle in (("bad.toml", "unknown tool 'not_installed_anywhere'"), ("schema.toml", "not a JSON Schema")):
        res = subprocess.run(
            [sys.executable, "-m", "strop.cli", "train", "--config", config, "--policy", "nowhere"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and needle in res.stderr, res.stderr


def test_renamed_tools_drive_a_real_episode_and_the_behaviour_counts(tiny_tokenizer, sandbox):
    """A config renaming every built-in: the policy calls the new names, the sandbox executes them,
    and the behaviour statistics still count edits, a retry after a rejected edit and test runs."""
    from strop.config import load_config

    cfg = load_config(None, [f"harness.tools={json.dumps(RENAMED + ['done=submit'])}"])
    config = harness_config(cfg.rollout, cfg.harness)
    harness = Harness(tiny_tokenizer, replace(DEMONSTRATION_HARNESS, max_context=4096, tools=config.tools))
    assert "edit_file" not in harness.tools.names and harness.tools.role("patch") == "edit"
    turns = [
        call("view", path="mod.py"),
        call("patch", path="mod.py", old="return a * b", new="return a + b"),  # rejected: no such text
        call("patch", path="mod.py", old="def add(a, b):\n    return a - b", new="def add(a, b):\n    return a + b"),
        call("shell", command="python -m pytest -q"),
        call("done"),
    ]
    episode = harness.run(ScriptedClient(turns, tiny_tokenizer), sandbox, "Fix add.")
    assert episode.stop_reason == "submitted", episode.detail
    assert [c["name"] for c in episode.tool_calls] == ["view", "patch", "patch", "shell", "done"]
    assert [c["role"] for c in episode.tool_calls] == ["read", "edit", "edit", "run", "submit"]
    assert episode.tool_calls[3]["output"].startswith("exit code 0") and "1 passed" in episode.tool_calls[3]["output"]
    stats = episode_stats(episode.tool_calls, episode.stop_reason, episode.turns)
    assert (stats["edits_applied"], stats["edits_rejected"], stats["test_runs"]) == (1, 1, 1)
    assert stats["rejected_edit"] == stats["retried_after_rejected_edit"] == 1
    assert stats["submitted"] == 1 and stats["submitted_untested"] == 0
    assert sandbox.read_file("mod.py").startswith(b"def add(a, b):\n    return a + b")
