"""Fuzz: hostile worlds. Random image layers and task-file records, drawn from seeded generators
as in `tests.test_fuzz` (`FAST` cases in the fast suite, `SLOW` times as many under `-m slow`), meet
one invariant: strop accepts them or refuses them in one line (`UserError`), and reads or writes
nothing outside what it was given (a victim directory of host files, reachable by absolute and
relative links, keeps its bytes and its times)."""

import io
import os
import random
import tarfile
from pathlib import Path

import pytest

from strop.env.host.node_cache import node_cache
from strop.env.world.image import image_root
from strop.errors import UserError
from tests.test_fuzz import FAST, SLOW

PIECES = ["etc", "usr", "a", "b", "..", ".", "", ".wh.", ".wh..", ".wh...", ".wh.a", ".wh..wh..opq", "x" * 300]


def snapshot(victim: Path) -> dict[str, tuple]:
    out = {}
    for d, dirs, files in os.walk(victim):
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            data = open(p, "rb").read() if os.path.isfile(p) and not os.path.islink(p) else b""
            out[os.path.relpath(p, victim)] = (st.st_mode, st.st_mtime_ns, data)
    return out


def victim_dir(tmp: Path) -> Path:
    victim = tmp / "victim"
    (victim / "dir").mkdir(parents=True)
    (victim / "passwd").write_text("VICTIM\n")
    return victim


def random_layer(rng: random.Random, path: Path, victim: Path) -> Path:
    """A tar of the base of a root and up to eight hostile members."""
    targets = ["/", "/etc", "..", "../../..", str(victim), "../" * 30 + str(victim).lstrip("/"), "a", "", "etc/passwd"]
    targets += [str(victim / "passwd"), "../" * 30 + str(victim / "passwd").lstrip("/")]
    with tarfile.open(path, "w") as tar:
        for name in ("usr", "etc"):
            info = tarfile.TarInfo(name)
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for _ in range(rng.randint(1, 8)):
            name = "/".join(rng.choice(PIECES) for _ in range(rng.randint(1, 4)))
            if rng.random() < 0.2:
                name = "/" + name
            info = tarfile.TarInfo(name)
            kind = rng.choice(["file", "dir", "sym", "hard", "chr", "fifo"])
            data = b""
            if kind == "file":
                data = rng.choice([b"", b"x", b"VICTIM\n" * 10])
                info.size = len(data)
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
            elif kind in ("sym", "hard"):
                info.type = tarfile.SYMTYPE if kind == "sym" else tarfile.LNKTYPE
                info.linkname = rng.choice(targets)
            else:
                info.type = tarfile.CHRTYPE if kind == "chr" else tarfile.FIFOTYPE
            info.mode = rng.choice([0o644, 0o4755, 0o000, 0o777])
            tar.addfile(info, io.BytesIO(data) if kind == "file" else None)
    return path


def fuzz_layers(n: int, seed: int, tmp: Path) -> None:
    rng = random.Random(seed)
    victim = victim_dir(tmp)
    before = snapshot(victim)
    refused = 0
    for i in range(n):
        archive = random_layer(rng, tmp / f"layer{i}.tar", victim)
        try:
            root = Path(image_root(str(archive)))
        except UserError as e:
            assert "\n" not in str(e), e
            refused += 1
        else:
            assert root.is_dir() and not any((root / "etc").glob("**/VICTIM*"))
        assert snapshot(victim) == before, archive
        assert not list((node_cache() / "images").glob(f".build-{os.getpid()}-*"))
    assert 0 < refused < n  # the generator draws both kinds


def test_fuzz_image_layers(tmp_path):
    fuzz_layers(40 * FAST, 0, tmp_path)


@pytest.mark.slow
def test_fuzz_image_layers_long(tmp_path):
    fuzz_layers(40 * SLOW, 1, tmp_path)


# ---- task-file records -------------------------------------------------------------------------

VALUES = [None, True, -1, 0, 1, 1.5, 1e308, float("nan"), "", "x", "-x", "/etc", "..", [], ["a"], {}, {"a": "b"}]
PATHS = ["/etc", "/etc/passwd", "..", "../../..", "escape", "escape/passwd", "inside", "file:///etc/shadow"]
PATHS += ["http://169.254.169.254/", "memory://x/y.tar", "git@h:x/y", "~root", "~/x", ""]
KEYS = ["m.py", "../m.py", "/m.py", "a/../../m.py", "", ".", "a//b", "-p", "a/./b", "x\0y", "tests/test_m.py"]
FIELDS = ["repo", "image", "files", "hidden_tests", "FAIL_TO_PASS", "metadata", "timeout_s", "memory_mb", "cpu_s"]
FIELDS += ["test_command", "split", "base_commit", "instance_id"]


def random_record(rng: random.Random) -> dict:
    """A sound record with one to three fields made hostile."""
    rec = {"instance_id": "t", "problem_statement": "p", "files": {"m.py": "x = 1\n"}}
    rec["hidden_tests"] = {"tests/test_m.py": "def test_a():\n    pass\n"}
    for name in rng.sample(FIELDS, rng.randint(1, 3)):
        if name in ("repo", "image"):
            rec[name] = rng.choice(PATHS + VALUES)
        elif name in ("files", "hidden_tests"):
            rec[name] = {rng.choice(KEYS): rng.choice(["x = 1\n", 1])} if rng.random() < 0.9 else rng.choice(VALUES)
        elif name == "FAIL_TO_PASS":
            rec[name] = [rng.choice(KEYS) + rng.choice(["", "::test_a"])] if rng.random() < 0.8 else rng.choice(VALUES)
        elif name == "metadata":
            rec[name] = {rng.choice(["timeout_s", "memory_mb", "cpu_s", "n_tests"]): rng.choice(VALUES + [30, 512])}
        else:
            rec[name] = rng.choice(VALUES + [30, 512])
    return rec


def fuzz_records(n: int, seed: int, tmp: Path) -> None:
    from strop.env.tasks.task_file import CEILINGS, task_from_record

    rng = random.Random(seed)
    files = tmp / "tasks"
    (files / "inside").mkdir(parents=True)
    (files / "escape").symlink_to("/etc")
    accepted = 0
    for i in range(n):
        rec = random_record(rng)
        try:
            task, _ = task_from_record(rec, f"t.jsonl:{i}", files, "jsonl:t")
        except UserError as e:
            assert "\n" not in str(e) and str(e).startswith(f"t.jsonl:{i}"), e
            continue
        accepted += 1
        for path in (task.repo, task.image):
            assert not path or path == "/" or Path(path).resolve().is_relative_to(files.resolve()), (rec, path)
        for key, ceiling in CEILINGS.items():
            assert 0 < task.metadata.get(key, 1) <= ceiling, rec
        for key in {**task.files, **task.hidden_tests}:
            assert not key.startswith(("/", "-")) and ".." not in key.split("/"), rec
    assert accepted  # the generator draws both kinds


def test_fuzz_task_records(tmp_path, monkeypatch):
    monkeypatch.delenv("STROP_TASK_SOURCES", raising=False)
    fuzz_records(300 * FAST, 0, tmp_path)


@pytest.mark.slow
def test_fuzz_task_records_long(tmp_path, monkeypatch):
    monkeypatch.delenv("STROP_TASK_SOURCES", raising=False)
    fuzz_records(300 * SLOW, 1, tmp_path)
