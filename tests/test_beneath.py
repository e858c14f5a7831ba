"""Writes into and reads from a directory the user handed strop never pass through a symbolic link
out of it (`strop.confined`), and `strop agent --apply` writes all of the agent's changes or none."""

import os
import stat

import pytest

from strop.confined import apply_changes, parts_of, read_beneath
from strop.errors import UserError
from tests.test_harness_endpoint import TURNS, server  # noqa: F401 (a fixture)


@pytest.fixture
def world(tmp_path):
    """DIR with a file, a link to a file outside it and a link to a folder outside it."""
    outside = tmp_path / "outside"
    (outside / "d").mkdir(parents=True)
    (outside / "secret.txt").write_text("the secret\n")
    (outside / "d" / "f").write_text("outside f\n")
    w = tmp_path / "world"
    w.mkdir()
    (w / "a.txt").write_text("a\n")
    (w / "link").symlink_to(outside / "secret.txt")
    (w / "sub").symlink_to(outside / "d")
    return w, outside


def untouched(outside) -> bool:
    return (outside / "secret.txt").read_text() == "the secret\n" and sorted(os.listdir(outside / "d")) == ["f"]


@pytest.mark.parametrize("rel", ["", "/etc/passwd", "../x", "a/../../x", "a//b", "./a", "a/.", "nul\0"])
def test_only_plain_relative_paths(rel):
    with pytest.raises(UserError, match="not a plain relative path"):
        parts_of(rel)


def test_a_write_through_a_linked_folder_is_refused_and_nothing_is_written(world):
    w, outside = world
    for changes in ({"new.txt": b"x", "sub/f": b"over"}, {"a.txt": None, "sub/g": b"new"}):
        with pytest.raises(UserError, match="'sub' is a symbolic link"):
            apply_changes(w, changes)
        assert untouched(outside) and (w / "a.txt").read_text() == "a\n" and not (w / "new.txt").exists()


def test_links_are_replaced_or_removed_never_followed(world):
    w, outside = world
    apply_changes(w, {"link": b"mine\n", "sub": None, "sub/f": b"y\n", "a.txt": None, "deep/er/n.txt": "n"})
    assert untouched(outside)
    assert stat.S_ISREG(os.lstat(w / "link").st_mode) and (w / "link").read_text() == "mine\n"
    assert not (w / "sub").is_symlink() and (w / "sub" / "f").read_text() == "y\n"
    assert not (w / "a.txt").exists() and (w / "deep" / "er" / "n.txt").read_text() == "n"


def test_refusals_before_any_write(world, tmp_path):
    w, outside = world
    (w / "dir").mkdir()
    os.mkfifo(w / "fifo")
    for changes, needle in [
        ({"x": b"1", "dir": b"2"}, "is a directory"),
        ({"x": b"1", "fifo": b"2"}, "not a regular file"),
        ({"x": b"1", "a.txt/y": b"2"}, "not a directory"),
        ({"x": b"1", "q": b"2", "q/r": b"3"}, "written as a file"),
        ({"x": b"1", "../escape": b"2"}, "not a plain relative path"),
    ]:
        with pytest.raises(UserError, match=needle):
            apply_changes(w, changes)
        assert not (w / "x").exists() and not (tmp_path / "escape").exists()
    assert untouched(outside)


def test_read_beneath_shows_a_link_not_what_it_points_at(world):
    w, outside = world
    assert read_beneath(w, "a.txt") == b"a\n"
    assert read_beneath(w, "link") == os.fsencode(outside / "secret.txt")
    assert read_beneath(w, "sub/f") is None and read_beneath(w, "missing") is None


def test_agent_apply_replaces_links_inside_dir_and_never_shows_or_writes_outside(
    tiny_tokenizer,
    server,  # noqa: F811
    world,
    tmp_path,
    capsys,
):
    """The issue's reproduction: the agent replaces a link to a file outside DIR and a linked folder;
    `--apply` wrote both targets outside DIR (under `-O`, where the one guard, an assert, is gone),
    and the diff printed the outside file's content."""
    from strop.cli import main
    from strop.env.demonstrators.scripted import ScriptedClient

    url, _, script = server
    w, outside = world
    tiny_tokenizer.save_pretrained(tmp_path / "tok")
    replace = "rm link sub && echo mine > link && mkdir sub && echo y > sub/f"
    script[0] = ScriptedClient(
        [f'<tool_call>{{"name": "run", "arguments": {{"command": "{replace}"}}}}</tool_call>', TURNS[1]],
        tiny_tokenizer,
    )
    argv = ["agent", "--repo", str(w), "--endpoint", url, "--tokenizer", str(tmp_path / "tok"), "--apply", "Go."]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "applied" in out and "the secret" not in out and "outside f" not in out
    assert untouched(outside)
    assert (w / "link").read_text() == "mine\n" and not (w / "link").is_symlink()
    assert (w / "sub" / "f").read_text() == "y\n" and not (w / "sub").is_symlink()


def test_tasks_export_writes_only_inside_dir_and_overwrites_nothing(tmp_path, capsys):
    """A task file (`jsonl:PATH`) can name any path: one leading out of DIR is refused before anything
    is written, and the instruction note beside DIR is made new, never written through a link."""
    import json

    from strop.cli import main

    def task_file(name: str, files: dict) -> str:
        tests = {"tests/test_ok.py": "def test_ok():\n    pass\n"}
        record = {"instance_id": "t1", "problem_statement": "Do it.", "files": files, "hidden_tests": tests}
        (tmp_path / name).write_text(json.dumps(record) + "\n")
        return f"jsonl:{tmp_path / name}"

    bad = task_file("bad.jsonl", {"ok.py": "x = 1\n", "../escape.py": "evil\n"})
    assert main(["tasks", "export", "--suite", bad, "t1", str(tmp_path / "out")]) == 2
    assert "'../escape.py' is not a plain relative path" in capsys.readouterr().err
    assert not (tmp_path / "escape.py").exists() and not (tmp_path / "out").exists()
    good = task_file("good.jsonl", {"ok.py": "x = 1\n"})
    (tmp_path / "target.txt").write_text("keep")
    (tmp_path / "linked.instruction.txt").symlink_to(tmp_path / "target.txt")
    assert main(["tasks", "export", "--suite", good, "t1", str(tmp_path / "linked")]) == 2
    assert "exists; export does not overwrite it" in capsys.readouterr().err
    assert (tmp_path / "target.txt").read_text() == "keep" and not (tmp_path / "linked").exists()
    assert main(["tasks", "export", "--suite", good, "t1", str(tmp_path / "fresh")]) == 0
    assert (tmp_path / "fresh" / "ok.py").read_text() == "x = 1\n"
    assert (tmp_path / "fresh.instruction.txt").read_text() == "Do it.\n"
