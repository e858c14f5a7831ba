"""OS images: every supported kind unpacks to the same root once per node, a sandbox on it runs the
image's programs and not the host's, bad input is one line and leaves nothing in the cache, and a
hostile layer writes nothing outside the root and keeps no privilege."""

import io
import os
import re
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import fsspec
import pytest

from strop.env.host.node_cache import node_cache
from strop.env.sandbox.backend import open_sandbox
from strop.env.sandbox.interface import Limits
from strop.env.world.image import image_root
from strop.errors import UserError
from tests.worldkit import MARKER, docker_archive, host_python, image_layers, oci_layout, test_image  # noqa: F401


def tree(root: str) -> dict[str, int]:
    return {
        os.path.relpath(os.path.join(d, n), root): os.lstat(os.path.join(d, n)).st_mode
        for d, dirs, files in os.walk(root)
        for n in files + dirs
    }


def test_every_kind_of_image_unpacks_to_the_same_root_once(image_layers, test_image, tmp_path):
    oci = image_root(test_image)
    assert image_root(test_image) == oci and oci.startswith(str(node_cache() / "images"))
    with tarfile.open(tmp_path / "oci.tar", "w") as tar:  # the same layout as one archive: the same key
        tar.add(test_image, arcname=".")
    assert image_root(str(tmp_path / "oci.tar")) == oci
    docker = image_root(str(docker_archive(tmp_path / "saved.tar", image_layers)))
    assert docker != oci and tree(docker) == tree(oci)
    with fsspec.open("memory://strop-test/saved.tar", "wb") as f:  # any fsspec URL: how every Ray node finds it
        f.write((tmp_path / "saved.tar").read_bytes())
    assert image_root("memory://strop-test/saved.tar") == docker
    rootfs = image_root(str(image_layers[0]))  # a root file system tarball: the base layer alone
    assert (Path(rootfs) / "etc/to-delete").exists() and not (Path(rootfs) / MARKER).exists()
    # whiteouts: the top layer deletes a file and hides a directory's old content
    assert not (Path(oci) / "etc/to-delete").exists() and os.listdir(Path(oci) / "etc/opaque") == ["new"]


def test_an_image_world_runs_the_images_programs_not_the_hosts(test_image, tmp_path):
    (tmp_path / "w").mkdir()
    image_python = subprocess.run([str(host_python()), "--version"], capture_output=True, text=True).stdout.strip()
    assert image_python != f"Python {sys.version.split()[0]}"  # the two interpreters can be told apart
    probe = f"python3 --version; cat /{MARKER}; ls /usr/bin/gcc {Path(__file__).parent}; echo $PATH"
    with open_sandbox(tmp_path / "w", Limits(timeout_s=20), image_root(test_image)) as sb:
        r = sb.exec(probe)
    lines = r.stdout.splitlines()
    assert lines[:2] == [image_python, "strop test image"], r.stdout + r.stderr
    assert "/usr/bin/gcc" in r.stderr and "No such file" in r.stderr and "test_images.py" not in r.stdout
    assert ".venv" not in lines[2]  # no strop interpreter on the image's PATH
    with open_sandbox(tmp_path / "w", Limits(timeout_s=20)) as sb:  # the host's root, for contrast
        assert sb.exec("python3 --version").stdout.strip() == f"Python {sys.version.split()[0]}"
        assert sb.exec(f"cat /{MARKER}").exit_code != 0


def layer(path: Path, *members: tuple) -> Path:
    """A tar of (name, kind, payload, mode) members; kind: file, dir, sym, hard, chr, fifo."""
    with tarfile.open(path, "w") as tar:
        for name, kind, payload, mode in members:
            info = tarfile.TarInfo(name)
            info.mode = mode
            data = b""
            if kind == "file":
                data = payload.encode()
                info.size = len(data)
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
            elif kind in ("sym", "hard"):
                info.type, info.linkname = (tarfile.SYMTYPE if kind == "sym" else tarfile.LNKTYPE), payload
            elif kind == "chr":
                info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
            tar.addfile(info, io.BytesIO(data) if kind == "file" else None)
    return path


BASE = (("usr", "dir", "", 0o755), ("etc", "dir", "", 0o755), ("etc/passwd", "file", "root:x:0:0::/:/bin/sh\n", 0o644))


def cache_entries() -> set[str]:
    d = node_cache() / "images"
    return {p.name for p in d.iterdir() if not p.name.endswith(".lock")} if d.exists() else set()


@pytest.mark.parametrize(
    "members, refused",
    [
        ((("../../strop-escape-dotdot", "file", "x", 0o644),), "leaves the root"),
        ((("etc/../../strop-escape-dotdot", "file", "x", 0o644),), "leaves the root"),
        ((("/tmp/strop-escape-absolute", "file", "x", 0o644),), None),  # stripped: inside the root
        (
            (
                ("tmp", "dir", "", 0o1777),
                ("esc", "sym", "/tmp", 0o777),
                ("esc/strop-escape-symlink", "file", "x", 0o644),
            ),
            None,
        ),
        ((("esc", "sym", "/tmp", 0o777), ("esc/strop-escape-symlink", "file", "x", 0o644)), "cannot be placed"),
        (
            (
                ("tmp", "dir", "", 0o1777),
                ("up", "sym", "../../../../tmp", 0o777),
                ("up/strop-escape-symlink", "file", "x", 0o644),
            ),
            None,
        ),
        ((("hl", "hard", "../../../../etc/passwd", 0o644),), "leaves the root"),
        ((("hl", "hard", "/etc/shadow", 0o644),), "not a file in the image"),
        ((("esc", "sym", "/", 0o777), ("hl", "hard", "esc/etc/shadow", 0o644)), "not a file in the image"),
        ((("dev", "dir", "", 0o755), ("dev/strop-null", "chr", "", 0o666), ("fifo", "fifo", "", 0o644)), None),
        ((("usr/bin", "dir", "", 0o755), ("usr/bin/su", "file", "#!/bin/sh\n", 0o4755)), None),
        ((("usr/sgid", "dir", "", 0o2755),), None),
    ],
    ids=[
        "dotdot",
        "dotdot-inside",
        "absolute",
        "symlink-out",
        "symlink-dangling",
        "symlink-up",
        "hardlink-dotdot",
        "hardlink-abs",
        "hardlink-via-symlink",
        "devices",
        "setuid",
        "setgid-dir",
    ],
)
def test_a_hostile_layer_writes_nothing_outside_and_keeps_no_privilege(tmp_path, members, refused):
    before = cache_entries()
    archive = layer(tmp_path / "hostile.tar", *BASE, *members)
    if refused:
        with pytest.raises(UserError, match=re.escape(refused)):
            image_root(str(archive))
        assert cache_entries() == before  # nothing half-written
    else:
        root = Path(image_root(str(archive)))
        modes = tree(str(root))
        assert not any(m & (stat.S_ISUID | stat.S_ISGID) for m in modes.values())
        assert not any(stat.S_ISCHR(m) or stat.S_ISBLK(m) or stat.S_ISFIFO(m) for m in modes.values())
        inside = [p for p in modes if p.endswith(("strop-escape-absolute", "strop-escape-symlink"))]
        assert len(inside) == sum(m[0].endswith(("absolute", "symlink")) for m in members) and all(
            p.startswith("tmp/") for p in inside
        )
    for name in ("strop-escape-dotdot", "strop-escape-absolute", "strop-escape-symlink"):
        assert not Path("/tmp", name).exists() and not Path("/", name).exists()
    assert Path("/etc/passwd").stat().st_nlink == 1 and not Path("/dev/strop-null").exists()


def test_bad_images_are_one_line_and_leave_nothing(tmp_path, test_image):
    before = cache_entries()
    truncated = tmp_path / "truncated.tar"
    with tarfile.open(tmp_path / "whole.tar", "w") as tar:
        tar.add(test_image, arcname=".")
    whole = (tmp_path / "whole.tar").read_bytes()
    truncated.write_bytes(whole[: len(whole) // 2])
    unique = ("etc/run", "file", str(tmp_path), 0o644)  # a fresh image each run: a cached one is never re-read
    corrupt = oci_layout(tmp_path / "corrupt", [layer(tmp_path / "l.tar", *BASE, unique)], gzip_first=False)
    blob = next(p for p in (corrupt / "blobs/sha256").iterdir() if p.stat().st_size > 1000)
    blob.write_bytes(blob.read_bytes().replace(b"root:x:0:0", b"evil:x:0:0"))
    (tmp_path / "notatar").write_bytes(b"not a tar archive\n" * 100)
    (tmp_path / "empty.tar").write_bytes(b"\x00" * 10240)  # a valid, empty tar
    (tmp_path / "plain").mkdir()
    cases = {
        str(tmp_path / "missing"): "does not exist",
        str(truncated): "corrupt or truncated",
        str(corrupt): "does not match its digest",
        str(tmp_path / "notatar"): "not a directory or a readable tar archive",
        str(tmp_path / "plain"): "not a system root",
        str(tmp_path / "empty.tar"): "holds no system root",
    }
    for spec, why in cases.items():
        with pytest.raises(UserError, match=why):
            image_root(spec)
        run = subprocess.run(
            [sys.executable, "-m", "strop.cli", "sandbox", "run", "--image", spec, "--", "true"], capture_output=True
        )
        assert run.returncode == 2 and run.stderr.decode().count("\n") == 1 and why in run.stderr.decode(), run.stderr
    assert cache_entries() == before
    assert not list((node_cache() / "images").glob(".build-*"))


@pytest.mark.parametrize("how", ["absolute", "relative"])
def test_a_hostile_images_links_take_no_byte_in_or_out_of_the_host(image_layers, tmp_path, how):
    """An image whose /etc files strop writes (passwd, group, hosts, hostname) and whose scratch
    directories (/tmp, /var/tmp, /home) are links to host files: a sandbox on it reads none of them
    (its passwd holds the image's users and `dev`, never a host file's lines) and writes none of
    them (strop's /etc files and the sandbox's writes stay in its own tree)."""
    victim = tmp_path / "victim"
    (victim / "dir").mkdir(parents=True)
    for name in ("passwd", "group", "hosts", "hostname"):
        (victim / name).write_text(f"VICTIM-{name}\n")
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in victim.iterdir() if p.is_file()}

    def to(path: Path) -> str:  # a link to a host path, absolute or climbing out with `..`
        return str(path) if how == "absolute" else "../" * 40 + str(path).lstrip("/")

    links = [(f"etc/{n}", "sym", to(victim / n), 0o777) for n in ("passwd", "group", "hosts", "hostname")]
    links += [(d, "sym", to(victim / "dir"), 0o777) for d in ("tmp", "home", "var/tmp")]
    hostile = layer(tmp_path / "hostile.tar", ("var", "dir", "", 0o755), *links)
    root = image_root(str(oci_layout(tmp_path / "oci", [*image_layers, hostile])))
    (tmp_path / "w").mkdir()
    with open_sandbox(tmp_path / "w", Limits(timeout_s=20), root) as sb:
        r = sb.exec("cat /etc/passwd /etc/group /etc/hosts /etc/hostname; id -un; echo x > /tmp/t; echo x > ~/h")
        sb.write_file("/tmp/by-strop", "x")
    assert r.exit_code == 0 and "VICTIM" not in r.stdout and "dev\n" in r.stdout, r
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in victim.iterdir() if p.is_file()} == before
    assert not list((victim / "dir").iterdir())


@pytest.mark.parametrize(
    "members, why",
    [
        ((("usr", "dir", "", 0o755), ("etc", "dir", "", 0o755), ("etc/passwd", "dir", "", 0o755)), "passwd"),
        ((("usr", "dir", "", 0o755), ("etc", "sym", "/etc", 0o777)), "holds no system root"),
        ((("usr", "sym", "/usr", 0o777), ("etc", "dir", "", 0o755)), "holds no system root"),
    ],
    ids=["passwd-a-directory", "etc-a-link", "usr-a-link"],
)
def test_an_image_with_an_unusable_etc_is_one_line(tmp_path, members, why):
    archive = layer(tmp_path / "bad.tar", *members)
    run = subprocess.run(
        [sys.executable, "-m", "strop.cli", "sandbox", "run", "--image", str(archive), "--", "true"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and why in run.stderr, run.stderr


def test_an_image_with_no_passwd_nor_group_gets_the_sandbox_user(tmp_path, image_layers):
    """An incomplete /etc (a distroless image has no passwd) is no error: the sandbox's files are made."""
    gone = layer(tmp_path / "gone.tar", ("etc/.wh.passwd", "file", "", 0o644), ("etc/.wh.group", "file", "", 0o644))
    root = image_root(str(oci_layout(tmp_path / "oci", [*image_layers, gone])))
    (tmp_path / "w").mkdir()
    with open_sandbox(tmp_path / "w", Limits(timeout_s=20), root) as sb:
        assert sb.exec("id -un; cat /etc/group").stdout == "dev\ndev:x:1000:\n"
