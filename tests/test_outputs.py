"""Output paths: a command deletes or overwrites only a directory a strop command made (its marker
inside, reached without following a link), never a folder of the user's; files later steps trust
are written whole or not at all."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from strop.config import load_config
from strop.errors import UserError
from strop.outputs import OUTPUT_MARKER, check_output_file, claim_dir, claiming, remove_output, write_atomic

REPO = Path(__file__).resolve().parents[1]


def demo(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "strop.cli", "demo", "--config", str(REPO / "examples/demo.toml"), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../x", "/abs", "-rf", ".hidden", "a\\b", "a\0b", "x" * 101])
def test_run_name_must_be_one_directory_name(name):
    with pytest.raises(UserError, match="run.name"):
        load_config(None, [f"run.name={name}"])


@pytest.mark.parametrize("name", ["", "..", "."])
def test_demo_fresh_with_a_path_as_run_name_deletes_nothing(tmp_path, name):
    """The reproduction: `--set run.name=..` deleted the parent of out_dir, `run.name=` out_dir itself."""
    out = tmp_path / "runs"
    (out / "sibling").mkdir(parents=True)
    (out / "sibling" / "summary.json").write_text("{}")
    (tmp_path / "precious.txt").write_text("keep me")
    res = demo("--fresh", "--set", f"run.out_dir={out}", "--set", f"run.name={name}")
    assert res.returncode == 2 and "Traceback" not in res.stderr and "run.name" in res.stderr, res.stderr
    assert (tmp_path / "precious.txt").read_text() == "keep me" and (out / "sibling" / "summary.json").is_file()


def test_demo_fresh_refuses_a_folder_it_did_not_make(tmp_path):
    out = tmp_path / "runs"
    (out / "mine").mkdir(parents=True)
    (out / "mine" / "thesis.tex").write_text("years of work")
    res = demo("--fresh", "--set", f"run.out_dir={out}", "--set", "run.name=mine")
    assert res.returncode == 2 and "not made by `strop demo`" in res.stderr, res.stderr
    assert (out / "mine" / "thesis.tex").is_file()


def test_demo_never_adopts_a_users_folder_so_fresh_cannot_delete_it(tmp_path):
    """The issue's reproduction: `strop demo` on an existing folder of the user's took it as a run
    (wrote summary.json into it); a later `strop demo --fresh` deleted the user's files."""
    home = tmp_path / "home"
    (home / "myproj").mkdir(parents=True)
    (home / "myproj" / "notes.txt").write_text("mine")
    for fresh in ([], ["--fresh"]):
        res = demo(*fresh, "--set", f"run.out_dir={home}", "--set", "run.name=myproj")
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and "not made by `strop demo`" in res.stderr
        assert sorted(os.listdir(home / "myproj")) == ["notes.txt"]


def test_demo_fresh_through_a_linked_out_dir_removes_only_its_run(tmp_path):
    """out_dir reached through a symlink: --fresh removes the demo's own run in the folder the link
    names (nothing else there), then starts again; it used to end in a FileExistsError traceback.
    The corpus is empty so that the new run stops at once, with one line."""
    real = tmp_path / "real"
    (real / "demo").mkdir(parents=True)
    (real / "demo" / OUTPUT_MARKER).write_text("demo\n")
    (real / "demo" / "summary.json").write_text("{}")
    (real / "keep.txt").write_text("x")
    (tmp_path / "link").symlink_to(real)
    res = demo("--fresh", "--set", f"run.out_dir={tmp_path / 'link'}", "--set", "data.stdlib=false")
    assert res.returncode == 2 and "Traceback" not in res.stderr and "corpus is empty" in res.stderr, res.stderr
    assert (real / "keep.txt").is_file() and not (real / "demo" / "summary.json").exists()
    assert (real / "demo" / OUTPUT_MARKER).read_text() == "demo\n"  # the new run's


@pytest.mark.parametrize(
    "summary", ["{not json", '{"midtrain": {"loss": 1}}', '{"midtrain": 3}', "[]", '{"sft": {"wall_s": "x"}}']
)
def test_demo_with_a_damaged_summary_says_so_in_one_line(tmp_path, summary):
    run = tmp_path / "runs" / "demo"
    run.mkdir(parents=True)
    (run / OUTPUT_MARKER).write_text("demo\n")
    (run / "summary.json").write_text(summary)
    res = demo("--set", f"run.out_dir={tmp_path / 'runs'}")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "damaged" in res.stderr and "--fresh" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_remove_output_guards(tmp_path, monkeypatch):
    out = tmp_path / "runs"
    run = out / "r"
    run.mkdir(parents=True)
    (run / OUTPUT_MARKER).write_text("demo\n")
    (run / "midtrain").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / OUTPUT_MARKER).write_text("demo\n")
    (elsewhere / "precious").write_text("x")
    (out / "link").symlink_to(elsewhere)
    (run / "inner-link").symlink_to(elsewhere)  # inside the run: removed itself, never followed
    with pytest.raises(UserError, match="symbolic link"):
        remove_output(out / "link", "demo")
    with pytest.raises(UserError, match="not made by `strop train`"):
        remove_output(run, "train")
    fake = out / "fake"
    fake.mkdir()
    (fake / OUTPUT_MARKER).symlink_to(elsewhere / OUTPUT_MARKER)  # a link named like the marker is no marker
    with pytest.raises(UserError, match="not made by"):
        remove_output(fake, "demo")
    with pytest.raises(UserError, match="names no directory"):
        remove_output(out / "..", "demo")
    monkeypatch.chdir(run / "midtrain")
    with pytest.raises(UserError, match="working directory"):
        remove_output(run, "demo")
    monkeypatch.chdir(tmp_path)
    remove_output(run, "demo")  # a run directory the demo made: removed
    assert not run.exists() and out.is_dir() and (elsewhere / "precious").is_file()
    remove_output(run, "demo")  # nothing there: nothing to do


def test_claiming_removes_only_what_it_made_when_the_setup_fails(tmp_path):
    new = tmp_path / "a" / "b" / "rl"
    with pytest.raises(UserError, match="refused"):
        with claiming(new, "train"):
            (new / "config.json").write_text("{}")
            raise UserError("refused")
    assert not (tmp_path / "a").exists()
    own = claim_dir(tmp_path / "own", "train")
    (own / "checkpoint").mkdir()
    with pytest.raises(UserError):
        with claiming(own, "train"):
            raise UserError("refused")
    assert (own / "checkpoint").is_dir()  # there before: left as it was


@pytest.mark.parametrize(
    "argv, folder",
    [
        (["midtrain", "--set", "run.out_dir={t}", "--set", "run.name=r"], "r/midtrain"),
        (["sft", "--set", "run.out_dir={t}", "--set", "run.name=r"], "r/sft"),
        (["bench", "async", "--out", "{t}/mine"], "mine"),
        (["bench", "scaleout", "--out", "{t}/mine"], "mine"),
    ],
)
def test_commands_that_write_a_directory_never_take_a_users_folder(tmp_path, argv, folder):
    """midtrain and sft overwrite model/ (and their caches) in their stage directory, the benchmarks
    delete and rewrite their runs in --out: each refuses a folder it did not make, before any work."""
    (tmp_path / folder).mkdir(parents=True)
    (tmp_path / folder / "model").mkdir()
    (tmp_path / folder / "model" / "weights.bin").write_text("the user's")
    res = subprocess.run(
        [sys.executable, "-m", "strop.cli", *[a.replace("{t}", str(tmp_path)) for a in argv]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr and "was not made by `strop" in res.stderr, res.stderr
    assert (tmp_path / folder / "model" / "weights.bin").read_text() == "the user's"
    assert sorted(p.name for p in (tmp_path / folder).iterdir()) == ["model"]


def test_claim_dir_never_takes_a_folder_it_did_not_make(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(UserError, match="not made by `strop train`"):
        claim_dir(model, "train")
    assert sorted(p.name for p in model.iterdir()) == ["config.json"]
    assert claim_dir(tmp_path / "new" / "rl", "train").is_dir()
    claim_dir(tmp_path / "new" / "rl", "train")  # its own: taken again (a resumed run)
    with pytest.raises(UserError, match="bench async"):
        claim_dir(tmp_path / "new" / "rl", "bench async")
    (tmp_path / "empty").mkdir()
    claim_dir(tmp_path / "empty", "train")
    with pytest.raises(UserError, match="not a directory"):
        claim_dir(model / "config.json", "train")
    (tmp_path / "linked").symlink_to(tmp_path / "empty")
    with pytest.raises(UserError, match="symbolic link"):
        claim_dir(tmp_path / "linked", "train")


def test_check_output_file(tmp_path):
    with pytest.raises(UserError, match="is a directory"):
        check_output_file(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        check_output_file(tmp_path / "missing" / "f.bin")
    assert check_output_file(tmp_path / "f.bin") == tmp_path / "f.bin"


def test_write_atomic_killed_mid_write_keeps_the_previous_file(tmp_path):
    """SIGKILL after the new bytes are written but before the rename: the old file stays whole,
    and the next write removes the dead writer's temporary file."""
    target = tmp_path / "delta.bin"
    target.write_bytes(b"good")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import os, time
        from strop import outputs
        def stall(fd):
            print("written", flush=True)
            time.sleep(60)
        outputs.os.fsync = stall
        outputs.write_atomic({str(target)!r}, os.urandom(1 << 20))
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert child.stdout.readline().strip() == "written"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert target.read_bytes() == b"good"
    assert len(list(tmp_path.iterdir())) == 2  # the target and the killed writer's temporary file
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new" and list(tmp_path.iterdir()) == [target]
