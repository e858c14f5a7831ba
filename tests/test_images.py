"""OS images: every supported kind unpacks to the same root once per node, a sandbox on it runs the
image's programs and not the host's, bad input is one line and leaves nothing in the cache, and a
hostile layer writes nothing outside the root and keeps no privilege."""

import hashlib
import io
import json
import os
import re
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import fsspec
import pytest

from strop.env.grading.checker import check
from strop.env.host.node_cache import node_cache
from strop.env.sandbox.backend import open_sandbox
from strop.env.sandbox.interface import Limits
from strop.env.task import Task
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
    """The image cache's entries and this process's builds (other test processes build beside it)."""
    d = node_cache() / "images"
    ours = lambda n: not n.startswith(".build-") or n.startswith(f".build-{os.getpid()}-")  # noqa: E731
    return {p.name for p in d.iterdir() if not p.name.endswith(".lock") and ours(p.name)} if d.exists() else set()


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
    assert not list((node_cache() / "images").glob(f".build-{os.getpid()}-*"))


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
    # the workspace: a repository whose test folder is a link out, where the checker writes the hidden tests
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "m.py").write_text("def f():\n    return 1\n")
    os.symlink(to(victim / "dir"), repo / "tests")
    hidden = {"tests/test_h.py": "from m import f\n\n\ndef test_f():\n    assert f() == 1\n"}
    task = Task(id="t", suite="t", split="eval", instruction="", repo=str(repo), hidden_tests=hidden, image=root)
    score = check(task, {"m.py": "def f():\n    return 1\n"}, perturbed=False)
    assert score.reward == 0 and "dangles" in score.reason  # the link leads nowhere inside: not written through
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


def _bomb(path: Path, kind: str, size: int) -> Path:
    """A layer of one file of `size` zero bytes, compressed (gzip or zstd) to almost nothing."""
    import gzip

    import zstandard

    with open(path, "wb") as raw:
        out = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1) if kind == "gz" else None
        out = out or zstandard.ZstdCompressor(level=1).stream_writer(raw, closefd=False)
        with tarfile.open(fileobj=out, mode="w|") as tar:
            for name, data in (("usr", None), ("etc", None)):
                info = tarfile.TarInfo(name)
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            info = tarfile.TarInfo("zeros")
            info.size = size
            tar.addfile(info, io.BufferedReader(io.BytesIO(bytes(size))))
        out.close()
    return path


def _in_layout(layer_path: Path) -> Path:
    return oci_layout(layer_path.with_suffix(".oci"), [layer_path], gzip_first=False)


def _layout_with_blob(tmp_path: Path, plant) -> str:
    """An OCI layout of one small layer whose blob `plant(blob_path, digest)` then replaces."""
    layout = oci_layout(
        tmp_path / "layout",
        [layer(tmp_path / "l.tar", *BASE, ("etc/u", "file", str(tmp_path), 0o644))],
        gzip_first=False,
    )
    index = json.loads((layout / "index.json").read_text())
    manifest_path = layout / "blobs/sha256" / index["manifests"][0]["digest"].split(":")[1]
    manifest = json.loads(manifest_path.read_text())
    plant(layout, manifest)
    data = json.dumps(manifest).encode()
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs/sha256" / digest).write_bytes(data)
    index["manifests"][0].update(digest=f"sha256:{digest}", size=len(data))
    (layout / "index.json").write_text(json.dumps(index))
    return str(layout)


def _devzero(layout: Path, manifest: dict) -> None:
    blob = layout / "blobs/sha256" / manifest["layers"][0]["digest"].split(":")[1]
    blob.unlink()
    os.symlink("/dev/zero", blob)


def _fifo_blob(layout: Path, manifest: dict) -> None:
    blob = layout / "blobs/sha256" / manifest["layers"][0]["digest"].split(":")[1]
    blob.unlink()
    os.mkfifo(blob)


def _md5(layout: Path, manifest: dict) -> None:
    manifest["layers"][0]["digest"] = "md5:" + "0" * 32


def _outside(layout: Path, manifest: dict) -> None:
    manifest["layers"][0]["digest"] = "sha256:../../../../../etc/passwd"


def _wrong_size(layout: Path, manifest: dict) -> None:
    manifest["layers"][0]["size"] += 1


def _not_a_list(layout: Path, manifest: dict) -> None:
    manifest["layers"] = {"oops": 1}


@pytest.mark.parametrize(
    "plant, why",
    [
        (_devzero, "is not a file of the layout"),
        (_fifo_blob, "is not a file of the layout"),
        (_md5, "unknown algorithm 'md5'"),
        (_outside, "is not a digest"),
        (_wrong_size, "where its descriptor says"),
        (_not_a_list, "malformed"),
    ],
    ids=["digest-at-dev-zero", "blob-a-fifo", "unknown-algorithm", "digest-outside", "wrong-size", "malformed"],
)
def test_a_hostile_layout_is_one_line_and_exit_2(tmp_path, plant, why):
    before = cache_entries()
    spec = _layout_with_blob(tmp_path, plant)
    run = subprocess.run(
        [sys.executable, "-m", "strop.cli", "sandbox", "run", "--image", spec, "--", "true"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and why in run.stderr, run.stderr
    assert cache_entries() == before


WHITEOUTS = {
    "empty-name": (("etc/.wh.", "file", "", 0o644),),
    "dot": (("etc/.wh..", "file", "", 0o644),),
    "dotdot": (("etc/.wh...", "file", "", 0o644),),
    "under-a-file": (("etc/passwd/.wh.x", "file", "", 0o644),),
    "opaque-under-a-file": (("etc/passwd/.wh..wh..opq", "file", "", 0o644),),
    "under-a-dangling-link": (("d", "sym", "/nowhere", 0o777), ("d/.wh.x", "file", "", 0o644)),
}


@pytest.mark.parametrize("members", list(WHITEOUTS.values()), ids=list(WHITEOUTS))
def test_hostile_whiteouts_are_one_line_and_remove_nothing_outside(tmp_path, members):
    before = cache_entries()
    archive = layer(tmp_path / "hostile.tar", *BASE, *members)
    with pytest.raises(UserError) as e:
        image_root(str(archive))
    assert "\n" not in str(e.value) and "whiteout" in str(e.value)
    assert cache_entries() == before and (node_cache() / "images").is_dir()


@pytest.mark.parametrize(
    "make, bounds, why",
    [
        (lambda p: _bomb(p, "gz", 48 << 20), {"ratio_floor": 8 << 20}, "decompression bomb"),
        (lambda p: _in_layout(_bomb(p, "zst", 48 << 20)), {"ratio_floor": 8 << 20}, "decompression bomb"),
        (lambda p: _in_layout(_bomb(p, "zst", 4 << 20)), {"max_bytes": 1 << 20}, "unpacks to more than"),
        (lambda p: layer(p, *BASE, *((f"f{i}", "file", "", 0o644) for i in range(50))), {"max_files": 20}, "entries"),
        (lambda p: layer(p, *BASE), {"max_seconds": 0}, "took longer than"),
    ],
    ids=["gzip-bomb", "zstd-bomb", "bytes", "files", "time"],
)
def test_unpacking_is_bounded(tmp_path, monkeypatch, make, bounds, why):
    from strop.env.world import layers

    monkeypatch.setattr(layers, "BOUNDS", layers.Bounds(**bounds), raising=False)
    before = cache_entries()
    with pytest.raises(UserError, match=why) as e:
        image_root(str(make(tmp_path / "layer.tar")))
    assert "\n" not in str(e.value) and cache_entries() == before


def test_an_image_path_that_is_a_fifo_is_one_line(tmp_path):
    os.mkfifo(tmp_path / "image.tar")
    with pytest.raises(UserError, match="neither a directory nor a file"):
        image_root(str(tmp_path / "image.tar"))
