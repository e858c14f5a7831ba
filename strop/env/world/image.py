"""OS images: the root a task's sandboxes run on. `image_root(spec)` turns what a task or config
names into a root directory:

- "" or "/": the host's root;
- an fsspec URL (s3://..., http://...) of an archive below: fetched into the node cache first;
- a directory holding `usr` and `etc`: that root, as it is;
- an OCI image layout (a directory with `oci-layout` and `index.json`, or a tar of one), a
  `docker save` archive (a tar with `manifest.json`), or a root filesystem tarball (e.g.
  `mmdebstrap ... img.tar`): unpacked once per node into the content-addressed cache
  `<node cache>/images/<key>/rootfs` (`strop.env.host.node_cache.node_cache`), shared by every
  sandbox of that image on the node.

The key is the image manifest's digest (OCI), the config's digest (Docker), or the tarball's sha256.
Layers are applied in order with whiteouts honoured (`strop.env.world.layers`), each checked against its
digest where the format records one. Unpacking goes to a temporary directory renamed into place
when complete, under a lock per key: a failure (a corrupt or truncated archive, a hostile layer)
leaves nothing in the cache.
"""

import hashlib
import io
import json
import os
import platform
import stat
import tarfile
from pathlib import Path
from typing import IO, Callable

from strop.env.host.account import reachable
from strop.env.host.node_cache import built, cache_dir, fetched, is_url
from strop.env.world.layers import LayerError, extract_layer
from strop.errors import UserError
from strop.memo import by_version

HOST_ROOT = "/"
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


class _Hashing(io.RawIOBase):
    """A reader that hashes what passes through and checks the digest at the end."""

    def __init__(self, f: IO[bytes], digest: str, what: str):
        self.f, self.what = f, what
        self.alg, _, self.want = digest.partition(":")
        self.h = hashlib.new(self.alg) if self.want else None

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        if self.h is not None:
            self.h.update(memoryview(b)[:n])
            if n == 0 and self.h.hexdigest() != self.want:
                raise LayerError(f"{self.what} does not match its digest {self.alg}:{self.want[:12]}...")
        return n


class _Source:
    """Blobs of an image by name: a directory, or the members of a tar archive."""

    def __init__(self, path: Path):
        self.path = path
        self.tar = None if path.is_dir() else tarfile.open(path)  # random access to the members
        # "./index.json" and "index.json" name the same blob
        self.members = {} if self.tar is None else {m.name.removeprefix("./"): m for m in self.tar.getmembers()}

    def exists(self, name: str) -> bool:
        if self.tar is None:
            return (self.path / name).is_file()
        return name in self.members and self.members[name].isfile()

    def open(self, name: str) -> IO[bytes]:
        if self.tar is None:
            return open(self.path / name, "rb")
        f = self.tar.extractfile(self.members[name]) if name in self.members else None
        if f is None:
            raise LayerError(f"{name} is not a file in the archive")
        return f

    def json(self, name: str, digest: str = "") -> dict:
        with self.open(name) as f:
            data = f.read(16 << 20)
        if digest and hashlib.new(digest.partition(":")[0], data).hexdigest() != digest.partition(":")[2]:
            raise LayerError(f"{name} does not match its digest")
        try:
            return json.loads(data)
        except json.JSONDecodeError:
            raise LayerError(f"{name} is not valid JSON") from None


def _blob(digest: str) -> str:
    alg, _, hexa = digest.partition(":")
    return f"blobs/{alg}/{hexa}"


def _oci_manifest(src: _Source) -> tuple[str, dict]:
    """(digest, manifest) of the one image of an OCI layout (this machine's platform in a multi-platform index)."""
    index = src.json("index.json")
    for _ in range(4):  # an index may point at another index
        manifests = index.get("manifests") or []
        if not manifests:
            raise LayerError("index.json lists no manifests")
        here = [m for m in manifests if m.get("platform", {}).get("architecture", _ARCH) == _ARCH]
        if len(here) > 1:
            refs = [m.get("annotations", {}).get("org.opencontainers.image.ref.name", m["digest"][:19]) for m in here]
            raise LayerError(f"the layout holds {len(here)} images ({', '.join(refs)}); keep one")
        if not here:
            raise LayerError(f"no image for this machine's platform ({_ARCH})")
        desc = here[0]
        doc = src.json(_blob(desc["digest"]), desc["digest"])
        if "layers" in doc:
            return desc["digest"], doc
        index = doc
    raise LayerError("index.json nests too deep")


def _layers(src: _Source) -> tuple[str, list[tuple[str, str]]]:
    """(cache key, [(blob name, digest or "")]) of an OCI layout or a `docker save` archive."""
    if src.exists("index.json") and src.exists("oci-layout"):
        digest, manifest = _oci_manifest(src)
        return digest.replace(":", "-"), [(_blob(d["digest"]), d["digest"]) for d in manifest["layers"]]
    entries = src.json("manifest.json")
    if not isinstance(entries, list) or len(entries) != 1:
        raise LayerError("manifest.json must describe exactly one image")
    config = entries[0].get("Config", "")
    with src.open(config) as f:
        key = "sha256-" + hashlib.sha256(f.read()).hexdigest()
    return key, [(name, "") for name in entries[0].get("Layers", [])]


def _is_image_archive(src: _Source) -> bool:
    return src.exists("manifest.json") or (src.exists("index.json") and src.exists("oci-layout"))


@by_version()
def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return "sha256-" + h.hexdigest()


def _is_system_root(path: Path) -> bool:
    """Whether `path` holds `usr` and `etc` as directories of its own (a link there is no system root:
    followed on the host, it would name the host's)."""
    return all(stat.S_ISDIR(os.lstat(path / d).st_mode) if os.path.lexists(path / d) else False for d in ("usr", "etc"))


def _unpack(key: str, apply: Callable[[int], None], what: str) -> str:
    """The cached root of `key`, unpacked by `apply(root_fd)` into a fresh directory on first use."""

    def build(tmp: Path) -> None:
        rootfs = tmp / "rootfs"
        rootfs.mkdir()
        fd = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY)
        try:
            apply(fd)
        finally:
            os.close(fd)
        if not _is_system_root(rootfs):
            raise LayerError("holds no system root (no usr/ and etc/ directories)")
        os.chmod(rootfs, 0o755)
        (tmp / "source.txt").write_text(what + "\n")

    try:
        return str(built(cache_dir("images") / key, build) / "rootfs")
    except LayerError as e:
        raise UserError(f"image {what}: {str(e).splitlines()[0]}") from None


def image_root(spec: str) -> str:
    """The root directory sandboxes of image `spec` run on (see the module docstring)."""
    if spec in ("", HOST_ROOT):
        return HOST_ROOT
    path = fetched(spec) if is_url(spec) else Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"image {spec!r} does not exist")
    path = path.resolve()
    if path.is_dir() and not (path / "oci-layout").exists():
        if not _is_system_root(path):
            raise UserError(f"image {spec!r} is a directory but not a system root (no usr/ and etc/)")
        if not reachable(path):
            raise UserError(f"image {spec!r} is not reachable by the sandbox account: put it where others may enter")
        return str(path)
    return _image_in_cache(str(path))


@by_version()
def _image_in_cache(path: str) -> str:
    p = Path(path)
    try:
        src = _Source(p)
    except (tarfile.TarError, OSError) as e:
        if "unexpected end" in str(e):
            raise UserError(f"image {path!r}: corrupt or truncated ({e})") from None
        raise UserError(f"image {path!r} is not a directory or a readable tar archive") from None
    try:
        if p.is_dir() or _is_image_archive(src):
            key, layers = _layers(src)

            def apply(root_fd: int) -> None:
                for name, digest in layers:
                    with src.open(name) as blob:
                        f = io.BufferedReader(_Hashing(blob, digest, name), 1 << 20) if digest else blob
                        extract_layer(f, root_fd)
                        while f.read(1 << 20):  # to the end (tar stops at its end marker): the digest is checked there
                            pass

            return _unpack(key, apply, path)
        key = _file_digest(path)  # a root filesystem tarball: one layer

        def apply_tarball(root_fd: int) -> None:
            with open(path, "rb") as f:
                extract_layer(f, root_fd)

        return _unpack(key, apply_tarball, path)
    except (LayerError, KeyError, tarfile.TarError, EOFError) as e:
        raise UserError(
            f"image {path!r}: {e if isinstance(e, LayerError) else f'corrupt or truncated ({e})'}"
        ) from None
