"""The coding tools, each run in a real bubblewrap sandbox: what they return, and that every bad
call comes back as an "error:" observation instead of an exception."""

import re

import pytest

from strop.env.harness.tools import clip, load_tools
from strop.env.sandbox.backend import open_sandbox
from strop.env.sandbox.interface import Limits

CODING = load_tools()  # the built-in tools, as the default [harness] declares them
TOOLS = CODING.schemas()
execute = CODING.execute


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    world = tmp_path_factory.mktemp("world")
    (world / "pkg").mkdir()
    (world / "pkg" / "mod.py").write_text("def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n")
    (world / "notes.txt").write_text("".join(f"line {i}\n" for i in range(1, 301)))
    (world / "blob.bin").write_bytes(bytes(range(256)))
    sb = open_sandbox(world, Limits(timeout_s=10))
    yield sb
    sb.close()


def ok(sb, name, **args) -> str:
    result = execute(sb, name, args)
    assert result.error is None, result.output
    return result.output


def err(sb, name, args) -> str:
    result = execute(sb, name, args)
    assert result.error is not None and result.output.startswith("error: "), result.output
    return result.error


def test_schemas_are_openai_functions():
    names = [t["function"]["name"] for t in TOOLS]
    assert names == ["read_file", "edit_file", "write_file", "list_dir", "grep", "run", "submit"]
    for t in TOOLS:
        assert t["type"] == "function" and t["function"]["parameters"]["type"] == "object"
        assert len(t["function"]["description"]) <= 60  # tiny-context budget


def test_read_file_numbers_lines_and_pages(sandbox):
    assert ok(sandbox, "read_file", path="pkg/mod.py", start=2, end=2) == "2|     return a - b"
    page = ok(sandbox, "read_file", path="notes.txt")
    assert page.startswith("1| line 1\n") and "120| line 120" in page and "121|" not in page
    assert page.endswith("[180 more lines; read with start=121]")
    assert ok(sandbox, "read_file", path="notes.txt", start=299) == "299| line 299\n300| line 300"
    assert "has 300 lines" in err(sandbox, "read_file", {"path": "notes.txt", "start": 400})
    assert "start <= end" in err(sandbox, "read_file", {"path": "notes.txt", "start": 5, "end": 2})
    assert err(sandbox, "read_file", {"path": "missing.py"}) == "no such file: missing.py"
    assert "is a directory" in err(sandbox, "read_file", {"path": "pkg"})
    assert "not a UTF-8 text file" in err(sandbox, "read_file", {"path": "blob.bin"})
    assert err(sandbox, "read_file", {"path": "pkg/mod.py/x"}) == "pkg/mod.py/x: Not a directory"
    ok(sandbox, "run", command="ln -s loop loop")
    assert "symbolic links" in err(sandbox, "read_file", {"path": "loop"})


def test_edit_file_exact_unique_replace(sandbox):
    ok(sandbox, "write_file", path="e.py", content="x = 1\ny = 1\n")
    assert "not found" in err(sandbox, "edit_file", {"path": "e.py", "old": "z = 1", "new": "z = 2"})
    assert "occurs 2 times" in err(sandbox, "edit_file", {"path": "e.py", "old": " = 1", "new": " = 2"})
    assert "must not be empty" in err(sandbox, "edit_file", {"path": "e.py", "old": "", "new": "q"})
    assert "the same" in err(sandbox, "edit_file", {"path": "e.py", "old": "x", "new": "x"})
    assert ok(sandbox, "edit_file", path="e.py", old="y = 1", new="y = 2") == "edited e.py (line 2)"
    assert sandbox.read_file("e.py") == b"x = 1\ny = 2\n"
    assert err(sandbox, "edit_file", {"path": "nope.py", "old": "a", "new": "b"}) == "no such file: nope.py"


def test_edit_not_found_shows_the_closest_text(sandbox):
    ok(sandbox, "write_file", path="f.py", content="def f(a, b):\n    if a <= b:\n        return a\n    return b\n")
    message = err(sandbox, "edit_file", {"path": "f.py", "old": "    if a < b:\n", "new": "    if a > b:\n"})
    assert message == "old text not found in f.py; closest text:\n2|     if a <= b:"
    two = err(sandbox, "edit_file", {"path": "f.py", "old": "if a<=b:\n        return(a)", "new": "x"})
    assert two.endswith("closest text:\n2|     if a <= b:\n3|         return a")
    assert err(sandbox, "edit_file", {"path": "f.py", "old": "import os", "new": "x"}) == "old text not found in f.py"


def test_write_file_creates_directories(sandbox):
    assert ok(sandbox, "write_file", path="a/b/c.py", content="pass\n") == "wrote a/b/c.py (1 lines)"
    assert sandbox.read_file("a/b/c.py") == b"pass\n"
    assert "is a directory" in err(sandbox, "write_file", {"path": "pkg", "content": "x"})


def test_list_dir_and_grep(sandbox):
    listing = ok(sandbox, "list_dir").split("\n")
    assert "pkg/" in listing and "pkg/mod.py" in listing and "notes.txt" in listing
    assert ok(sandbox, "list_dir", path="pkg") == "mod.py"
    assert "No such file" in err(sandbox, "list_dir", {"path": "nowhere"})
    assert ok(sandbox, "grep", pattern=r"def (add|sub)\(") == "pkg/mod.py:1:def add(a, b):\npkg/mod.py:5:def sub(a, b):"
    assert ok(sandbox, "grep", pattern="no such text anywhere") == "no matches"
    assert err(sandbox, "grep", {"pattern": "("})  # a bad regex is grep's error, reported
    hits = ok(sandbox, "grep", pattern="line", path="notes.txt")
    assert hits.endswith("[240 more lines]")


def test_run_reports_exit_codes_timeouts_and_floods(sandbox):
    assert ok(sandbox, "run", command="echo hi; echo oops >&2; exit 3") == "exit code 3\nhi\noops"
    assert ok(sandbox, "run", command="kill -SEGV $$").startswith("exit code 139")
    assert ok(sandbox, "run", command="python -c 'import os; os.abort()'").startswith("exit code 134")
    assert "timed out after 1 s" in err(sandbox, "run", {"command": "sleep 20", "timeout": 1})
    flood = ok(sandbox, "run", command="yes 0123456789 | head -c 3000000; echo END")
    assert len(flood) < 2200 and "chars cut" in flood and "(output capped)" in flood
    assert "at least 1 second" in err(sandbox, "run", {"command": "true", "timeout": 0})


def test_run_leaves_out_pytest_durations(sandbox):
    """An observation must not depend on the machine's speed: pytest's summary line loses its time."""
    sandbox.write_file("tests/test_add.py", "def test_one():\n    assert 1\n\n\ndef test_two():\n    assert 0\n")
    out = ok(sandbox, "run", command="python -m pytest -q -p no:cacheprovider tests/test_add.py")
    assert out.endswith("1 failed, 1 passed") and " in 0." not in out, out
    out = ok(sandbox, "run", command="python -m pytest -p no:cacheprovider tests/test_add.py")
    assert re.fullmatch(r"=+ 1 failed, 1 passed =+", out.splitlines()[-1]), out
    assert ok(sandbox, "run", command="echo 'took 2 s in 0.5s'") == "exit code 0\ntook 2 s in 0.5s"
    ok(sandbox, "run", command="rm -r tests")


def test_bad_calls_are_observations(sandbox):
    assert "unknown tool 'fly'" in err(sandbox, "fly", {})
    assert "needs argument(s) path" in err(sandbox, "read_file", {})
    assert "must be an integer" in err(sandbox, "read_file", {"path": "x", "start": "1"})
    assert "must be an integer" in err(sandbox, "read_file", {"path": "x", "start": True})
    assert "must be a string" in err(sandbox, "run", {"command": ["ls"]})
    assert "has no argument 'color'" in err(sandbox, "list_dir", {"color": "red"})
    assert "NUL" in err(sandbox, "read_file", {"path": "a\x00b"})
    assert "must be a JSON object" in err(sandbox, "run", '{"command": ')
    submitted = execute(sandbox, "submit", {})
    assert submitted.submitted and submitted.output == "submitted"


def test_clip_keeps_head_and_tail():
    text = "A" * 1000 + "Z" * 1000
    cut = clip(text, 200)
    assert cut.startswith("A" * 80) and cut.endswith("Z" * 80) and "chars cut" in cut and len(cut) <= 200
    assert clip("short", 200) == "short"
