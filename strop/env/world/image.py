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
Layers are applied in order with whiteouts honoured (`strop.env.world.layers`), within the image's
bounds (bytes, entries, expansion, time), each checked against its digest and size where the format
records them. An image is untrusted: a digest is one of OCI's registered algorithms over hex (it
also names the blob's file), a blob is a regular file of the layout reached without a link (never
/dev/zero or a host file), its index and manifest have the formats' shapes, the image path is a
directory or a regular file (never a fifo, which would be waited on): anything else is one line.
Unpacking goes to a temporary directory renamed into place when complete, under a lock per key: a
failure (a corrupt or truncated archive, a hostile layer) leaves nothing in the cache.
"""

import hashlib
import io
import json
import os
import platform
import re
import stat
import tarfile
from pathlib import Path
from typing import IO, Callable

from strop.confined import lstat_beneath, open_beneath
from strop.env.host.account import reachable
from strop.env.host.node_cache import built, cache_dir, fetched, is_url
from strop.env.world.layers import Budget, LayerError, extract_layer
from strop.errors import UserError
from strop.memo import by_version

HOST_ROOT = "/"
_JSON_BYTES = 16 << 20  # the most of an index, manifest or config read
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


DIGEST = re.compile(r"(sha256|sha384|sha512):[0-9a-f]{32,128}")  # OCI's registered algorithms, lower-case hex


def _checked(digest: object) -> str:
    """`digest` if it is one an image may name (`DIGEST`), else LayerError: it also names the blob's file."""
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        alg = str(digest).partition(":")[0][:20]
        if alg not in ("sha256", "sha384", "sha512") and ":" in str(digest):
            raise LayerError(f"digest {str(digest)[:40]!r} uses an unknown algorithm {alg!r}")
        raise LayerError(f"{str(digest)[:80]!r} is not a digest")
    return digest


class _Hashing(io.RawIOBase):
    """A reader that hashes what passes through and checks the digest at the end."""

    def __init__(self, f: IO[bytes], digest: str, what: str):
        self.f, self.what = f, what
        self.alg, _, self.want = digest.partition(":")
        self.h = hashlib.new(self.alg)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
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
            st = lstat_beneath(self.path, name)
            return st is not None and stat.S_ISREG(st.st_mode)
        return name in self.members and self.members[name].isfile()

    def open(self, name: str, size: int | None = None) -> IO[bytes]:
        """The blob `name`: a regular file of the layout reached without a link (a link or a device
        there would read a host file, or forever), of `size` bytes where the descriptor says."""
        if self.tar is None:
            try:
                f = open_beneath(self.path, name)
            except (OSError, UserError):
                raise LayerError(f"{name} is not a file of the layout") from None
            actual = os.fstat(f.fileno()).st_size
        else:
            member = self.members.get(name)
            f = self.tar.extractfile(member) if member is not None else None
            if f is None:
                raise LayerError(f"{name} is not a file in the archive")
            actual = member.size
        if size is not None and actual != size:
            f.close()
            raise LayerError(f"{name} holds {actual} bytes where its descriptor says {size}")
        return f

    def json(self, name: str, digest: str = "") -> dict:
        with self.open(name) as f:
            data = f.read(_JSON_BYTES)
        if digest and hashlib.new(digest.partition(":")[0], data).hexdigest() != digest.partition(":")[2]:
            raise LayerError(f"{name} does not match its digest")
        try:
            return json.loads(data)
        except json.JSONDecodeError:
            raise LayerError(f"{name} is not valid JSON") from None


def _blob(digest: object) -> str:
    alg, _, hexa = _checked(digest).partition(":")
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


Layer = tuple[str, str, int | None]  # blob name, digest ("": none recorded), size (None: not recorded)


def _layers(src: _Source) -> tuple[str, list[Layer]]:
    """(cache key, its layers) of an OCI layout or a `docker save` archive; LayerError when its
    index or manifest is not the shape the formats give them."""
    try:
        if src.exists("index.json") and src.exists("oci-layout"):
            digest, manifest = _oci_manifest(src)
            layers = [(_blob(d["digest"]), d["digest"], _size(d)) for d in manifest["layers"]]
            return digest.replace(":", "-"), layers
        entries = src.json("manifest.json")
        if not isinstance(entries, list) or len(entries) != 1:
            raise LayerError("manifest.json must describe exactly one image")
        with src.open(str(entries[0].get("Config", ""))) as f:
            key = "sha256-" + hashlib.sha256(f.read(_JSON_BYTES)).hexdigest()
        return key, [(str(name), "", None) for name in entries[0].get("Layers", [])]
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise LayerError(f"its index or manifest is malformed ({type(e).__name__}: {str(e)[:80]})") from None


def _size(descriptor: dict) -> int | None:
    size = descriptor.get("size")
    if size is not None and (type(size) is not int or size < 0):
        raise LayerError(f"descriptor size {str(size)[:40]!r} is not a size")
    return size


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
    if not stat.S_ISDIR(path.stat().st_mode) and not stat.S_ISREG(path.stat().st_mode):
        raise UserError(f"image {spec!r} is neither a directory nor a file")  # a fifo would be waited on forever
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
                budget = Budget()  # the image's, across its layers
                for name, digest, size in layers:
                    with src.open(name, size) as blob:
                        f = io.BufferedReader(_Hashing(blob, digest, name), 1 << 20) if digest else blob
                        extract_layer(f, root_fd, budget)
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
