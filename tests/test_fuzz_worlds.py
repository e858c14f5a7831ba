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
        assert not list((node_cache() / "images").glob(".build-*"))
    assert 0 < refused < n  # the generator draws both kinds


def test_fuzz_image_layers(tmp_path):
    fuzz_layers(40 * FAST, 0, tmp_path)


@pytest.mark.slow
def test_fuzz_image_layers_long(tmp_path):
    fuzz_layers(40 * SLOW, 1, tmp_path)
