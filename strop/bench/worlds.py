"""Real worlds made on this machine, for `strop bench envs` and the tests: a small OS image
assembled from this machine's own Debian programs (a shell, coreutils, procps, the distribution's
python3 with pytest added) as image archives of every supported kind, and a git repository with a
few fix-and-test commits.

The image is what a user's would be: a root file system in layers. It holds the host's
/usr/bin/python3 (Debian's build, not the interpreter strop runs on), a marker file the host lacks,
and lacks most of what the host has (gcc, this checkout), so tests can tell the two roots apart.
"""

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from strop.env.sandbox.python import requirement_closure
from strop.env.world.repo import git

PROGRAMS = (
    "sh dash bash cat ls env id ps sleep kill tr wc head tail grep mkdir rm rmdir touch echo printf true false "
    "timeout hostname uname dd stat chmod ln cp mv find sed seq whoami tee sort cut xargs readlink dirname "
    "basename test pwd unshare python3 python3.11 git mount diff cmp od nproc yes fallocate truncate nohup chrt du "
    "df mkfifo"
).split()
MARKER = "etc/strop-test-image"


def host_python() -> Path | None:
    """Debian's python3 on this machine (the image's interpreter), if it has one."""
    p = Path("/usr/bin/python3.11")
    return p if p.exists() and Path("/usr/lib/python3.11/os.py").exists() else None


def _libs(binary: Path) -> set[Path]:
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
    found = set()
    for line in out.splitlines():
        for word in line.split():
            if word.startswith("/") and Path(word).exists():
                found.add(Path(word))
    return found


def _in_image(path: Path) -> str:
    """Where a host library goes in the usr-merged image: under its own name (a symlink's name is
    what the loader asks for), with /lib and /lib64 moved under /usr."""
    p = os.path.normpath(str(path)).lstrip("/")
    return "usr/" + p if p.startswith(("lib/", "lib64/")) else p


def _add(tar: tarfile.TarFile, src: Path, name: str) -> None:
    info = tar.gettarinfo(str(src), arcname=name)
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    if info.isreg():
        with open(src, "rb") as f:
            tar.addfile(info, f)
    else:
        tar.addfile(info)


def _dir(tar: tarfile.TarFile, name: str, mode: int = 0o755) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, mode
    tar.addfile(info)


def _link(tar: tarfile.TarFile, name: str, target: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    tar.addfile(info)


def _text(tar: tarfile.TarFile, name: str, text: str, mode: int = 0o644) -> None:
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))


def base_layer(path: Path, packages: tuple[str, ...] = ("pytest",)) -> Path:
    """The image's first layer, a tar of a usr-merged root file system with `packages` (and what
    they require) from this environment among its Python's packages."""
    files: dict[str, Path] = {}
    for prog in PROGRAMS:
        src = shutil.which(prog, path="/usr/bin:/usr/sbin:/bin:/sbin")
        if src is None:
            continue
        real = Path(os.path.realpath(src))
        files[f"usr/bin/{prog}"] = real
        for lib in _libs(real):
            files[_in_image(lib)] = Path(os.path.realpath(lib))
    stdlib = Path("/usr/lib/python3.11")
    for f in stdlib.rglob("*"):
        rel = f.relative_to(stdlib)
        if f.is_file() and not f.is_symlink() and rel.parts[0] not in ("test", "idlelib", "tkinter", "lib2to3"):
            if "__pycache__" not in rel.parts:
                files[f"usr/lib/python3.11/{rel}"] = f
    for f in Path("/usr/lib/python3.11/lib-dynload").glob("*.so"):
        for lib in _libs(f):
            files[_in_image(lib)] = Path(os.path.realpath(lib))
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    tops = {f.parts[0] for d in requirement_closure(packages) for f in d.files or [] if f.parts[0] != ".."}
    for top in sorted(tops - {"__pycache__"}):
        src = site / top
        for f in [src] if src.is_file() else src.rglob("*") if src.exists() else []:
            if f.is_file() and "__pycache__" not in f.parts:
                files[f"usr/lib/python3/dist-packages/{f.relative_to(site)}"] = f
    with tarfile.open(path, "w") as tar:
        for d in ("usr", "usr/bin", "usr/sbin", "usr/lib", "usr/lib64", "etc", "var", "var/tmp", "tmp", "home"):
            _dir(tar, d, 0o1777 if d.endswith("tmp") else 0o755)
        for name in ("bin", "sbin", "lib", "lib64"):
            _link(tar, name, f"usr/{name}")
        _link(tar, "usr/bin/python", "python3")
        made = set()
        for name in sorted(files):
            parent = name.rpartition("/")[0]
            for i in range(len(parent.split("/"))):
                d = "/".join(parent.split("/")[: i + 1])
                if d not in made and d not in ("usr", "usr/bin", "usr/lib", "usr/lib64"):
                    made.add(d)
                    _dir(tar, d)
            _add(tar, files[name], name)
        _text(tar, "etc/passwd", "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/:/bin/sh\n")
        _text(tar, "etc/group", "root:x:0:\nnogroup:x:65534:\n")
        _text(tar, "etc/shadow", "root:*:19000:0:99999:7:::\n", 0o640)
        _text(tar, "etc/os-release", 'PRETTY_NAME="strop test image"\nID=strop-test\n')
        _text(tar, "etc/to-delete", "a lower layer's file\n")
        _dir(tar, "etc/opaque")
        _text(tar, "etc/opaque/old", "hidden by the next layer\n")
    return path


def top_layer(path: Path) -> Path:
    """The second layer: the marker file, a whiteout and an opaque directory."""
    with tarfile.open(path, "w") as tar:
        _text(tar, MARKER, "strop test image\n")
        _text(tar, "etc/.wh.to-delete", "")
        _dir(tar, "etc/opaque")
        _text(tar, "etc/opaque/.wh..wh..opq", "")
        _text(tar, "etc/opaque/new", "this layer's\n")
    return path


def _blob(layout: Path, data: bytes, media: str) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"mediaType": media, "digest": f"sha256:{digest}", "size": len(data)}


def oci_layout(dest: Path, layers: list[Path], gzip_first: bool = True) -> Path:
    """An OCI image layout directory of `layers` (the first gzip-compressed, as registries ship them)."""
    import gzip

    dest.mkdir(parents=True)
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    descs = []
    for i, layer in enumerate(layers):
        data = layer.read_bytes()
        if i == 0 and gzip_first:
            descs.append(_blob(dest, gzip.compress(data, 1, mtime=0), "application/vnd.oci.image.layer.v1.tar+gzip"))
        else:
            descs.append(_blob(dest, data, "application/vnd.oci.image.layer.v1.tar"))
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers"}}).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": _blob(dest, config, "application/vnd.oci.image.config.v1+json"),
        "layers": descs,
    }
    desc = _blob(dest, json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")
    (dest / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [desc]}))
    return dest


def docker_archive(dest: Path, layers: list[Path]) -> Path:
    """A `docker save` archive of `layers`."""
    config = json.dumps({"architecture": "amd64", "os": "linux", "strop": "docker save"}).encode()
    with tarfile.open(dest, "w") as tar:
        names = []
        for i, layer in enumerate(layers):
            names.append(f"layer{i}/layer.tar")
            tar.add(layer, arcname=names[-1])
        info = tarfile.TarInfo("config.json")
        info.size = len(config)
        tar.addfile(info, io.BytesIO(config))
        manifest = json.dumps([{"Config": "config.json", "RepoTags": ["strop/test:1"], "Layers": names}]).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
    return dest


CALC_V1 = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
TESTS_V1 = "from calc import add, mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"


def fix_and_test_repo(path: Path) -> dict[str, str]:
    """A git repository with commits that fix a bug together with a test for it (the miner's
    candidates), one that only changes code, one that only changes docs, and one whose new test
    passes before the fix too. Returns commit name -> sha."""
    path.mkdir(parents=True)
    git("init", "-q", "-b", "main", cwd=path)
    (path / "calc.py").write_text(CALC_V1)
    (path / "tests").mkdir()
    (path / "tests" / "test_calc.py").write_text(TESTS_V1)
    (path / "run.sh").write_text("#!/bin/sh\necho run\n")
    (path / "run.sh").chmod(0o755)
    (path / "logo.bin").write_bytes(bytes(range(256)))
    os.symlink("calc.py", path / "calc_link.py")
    git("add", "-A", cwd=path)
    git("commit", "-q", "-m", "initial", cwd=path)
    shas = {"initial": git("rev-parse", "HEAD", cwd=path).strip()}

    def commit(name: str, message: str, **files: str) -> None:
        for rel, text in files.items():
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            (path / rel).write_text(text)
        git("add", "-A", cwd=path)
        git("commit", "-q", "-m", message, cwd=path)
        shas[name] = git("rev-parse", "HEAD", cwd=path).strip()

    commit(
        "fix_add",
        "Fix add: it subtracted\n\nadd(1, 2) returned -1.",
        **{
            "calc.py": CALC_V1.replace("a - b", "a + b"),
            "tests/test_calc.py": TESTS_V1 + "\n\ndef test_add():\n    assert add(1, 2) == 3\n",
        },
    )
    commit("docs", "Document calc", **{"README.md": "# calc\n"})
    commit(
        "already_passing",
        "Refactor mul and test it more",
        **{
            "calc.py": CALC_V1.replace("a - b", "a + b").replace("return a * b", "return b * a"),
            "tests/test_calc.py": TESTS_V1
            + "\n\ndef test_add():\n    assert add(1, 2) == 3\n\n\ndef test_mul_zero():\n    assert mul(0, 5) == 0\n",
        },
    )
    calc = CALC_V1.replace("a - b", "a + b").replace("return a * b", "return b * a")
    commit(
        "add_sub",
        "Add sub",
        **{
            "calc.py": calc + "\n\ndef sub(a, b):\n    return a - b\n",
            "tests/test_calc.py": TESTS_V1.replace("import add, mul", "import add, mul, sub")
            + "\n\ndef test_add():\n    assert add(1, 2) == 3\n\n\ndef test_mul_zero():\n    assert mul(0, 5) == 0\n"
            + "\n\ndef test_sub():\n    assert sub(3, 1) == 2\n",
        },
    )
    return shas
