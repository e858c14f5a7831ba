"""Unpacking a tar layer (an OCI or Docker image layer, a root filesystem tarball, a repository
tarball) into a directory, safely, with OCI whiteouts honoured.

Every path is resolved by the kernel inside the target (`openat2` with RESOLVE_IN_ROOT, see
`strop.confined.open_in_root`): an absolute symlink in an image points inside the image, as it
will inside a sandbox, and no member can reach the host through `..`, an absolute name or a
symlink planted by an earlier member or layer. Names with a `..` component are refused outright
(no real image has them). Hard links must name a regular file inside the target. Device nodes,
fifos and sockets are skipped (a sandbox gets a fresh /dev), setuid and setgid bits dropped, and
owners not kept (the unpacking account owns every file): a layer carries no privilege.

Why not a tool: umoci and skopeo (Debian packages) need root to install and a Go runtime, and the
standard library's tar filters on this Python (3.11.7) have known bypasses (CVE-2025-4517) and
refuse the absolute symlinks every Debian image holds; `tarfile` here only parses, the kernel confines.
"""

import errno
import gzip
import io
import lzma
import os
import shutil
import stat
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import IO

import zstandard

from strop.confined import makedirs_in_root, open_in_root, rmtree

WHITEOUT, OPAQUE = ".wh.", ".wh..wh..opq"
_MAGIC = {b"\x1f\x8b": "gz", b"BZh": "bz2", b"\xfd7zXZ\x00": "xz"}
_ZSTD = b"\x28\xb5\x2f\xfd"


class LayerError(ValueError):
    """A layer that cannot be unpacked: corrupt, truncated, or hostile (says which member)."""


@dataclass
class LayerStats:
    files: int = 0
    skipped_special: int = 0  # devices, fifos, sockets
    whiteouts: int = 0
    created: set[str] = field(default_factory=set)  # this layer's paths: its own whiteouts never hide them


def _member_path(name: str) -> str:
    """The member's path relative to the root ("" for the root itself), or LayerError."""
    parts = [p for p in PurePosixPath(name.lstrip("/")).parts if p != "."]
    if ".." in parts:
        raise LayerError(f"member {name!r} leaves the root ('..')")
    return "/".join(parts)


def open_layer(f: IO[bytes]) -> tarfile.TarFile:
    """A streaming tar reader over `f`, uncompressing gzip, bzip2, xz or zstd by their magic bytes."""
    if not hasattr(f, "peek"):
        f = io.BufferedReader(f)  # type: ignore[arg-type]
    head = f.peek(8)[:8]
    if head.startswith(_ZSTD):
        return tarfile.open(fileobj=zstandard.ZstdDecompressor().stream_reader(f), mode="r|")
    comp = next((c for m, c in _MAGIC.items() if head.startswith(m)), "")
    return tarfile.open(fileobj=f, mode=f"r|{comp}" if comp else "r|")


def _remove_at(pfd: int, name: str) -> None:
    """Remove `name` in the directory `pfd` (a whole tree if it is a directory; links not followed)."""
    try:
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        rmtree(name, dir_fd=pfd)
    else:
        os.unlink(name, dir_fd=pfd)


def _parent(root_fd: int, path: str) -> tuple[int, str]:
    """(fd of the directory that holds `path`, created if missing, confined; the last name)."""
    parent, _, name = path.rpartition("/")
    return makedirs_in_root(root_fd, parent), name


def _mode(member: tarfile.TarInfo) -> int:
    return member.mode & 0o1777  # no setuid, no setgid


def extract_layer(f: IO[bytes], root_fd: int) -> LayerStats:
    """Apply one layer read from `f` to the tree whose root directory is open as `root_fd`."""
    stats = LayerStats()
    try:
        with open_layer(f) as tar:
            for member in tar:
                _apply(tar, member, root_fd, stats)
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error, lzma.LZMAError, zstandard.ZstdError) as e:
        raise LayerError(f"corrupt or truncated layer: {e}") from None
    return stats


def _apply(tar: tarfile.TarFile, member: tarfile.TarInfo, root_fd: int, stats: LayerStats) -> None:
    path = _member_path(member.name)
    if not path:
        return  # the root itself
    base = path.rpartition("/")[2]
    if base == OPAQUE or base.startswith(WHITEOUT):
        stats.whiteouts += 1
        parent = path.rpartition("/")[0]
        mfd = makedirs_in_root(root_fd, parent)
        pfd = open_in_root(mfd, "/", os.O_RDONLY | os.O_DIRECTORY)  # listable, unlike an O_PATH fd
        os.close(mfd)
        try:
            prefix = f"{parent}/" if parent else ""
            hidden = os.listdir(pfd) if base == OPAQUE else [base[len(WHITEOUT) :]]  # what lower layers put there
            for entry in hidden:
                if prefix + entry not in stats.created:
                    _remove_at(pfd, entry)
        finally:
            os.close(pfd)
        return
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):  # devices, fifos
        stats.skipped_special += 1
        return
    stats.created.add(path)
    try:
        pfd, name = _parent(root_fd, path)
    except (NotADirectoryError, FileExistsError) as e:
        raise LayerError(f"member {member.name!r} cannot be placed inside the root: {e.strerror}") from None
    try:
        if member.isdir():
            try:
                if not stat.S_ISDIR(os.stat(name, dir_fd=pfd, follow_symlinks=False).st_mode):
                    _remove_at(pfd, name)
                    os.mkdir(name, 0o700, dir_fd=pfd)
            except FileNotFoundError:
                os.mkdir(name, 0o700, dir_fd=pfd)
            dfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=pfd)
            try:
                os.fchmod(dfd, _mode(member) | 0o700)
            finally:
                os.close(dfd)
            return
        _remove_at(pfd, name)  # a later layer replaces what an earlier one put here
        stats.files += 1
        if member.issym():
            os.symlink(member.linkname, name, dir_fd=pfd)
        elif member.islnk():
            target = _member_path(member.linkname)
            try:
                tfd = open_in_root(root_fd, target, os.O_PATH | os.O_NOFOLLOW)
            except OSError:
                raise LayerError(
                    f"hard link {member.name!r} names {member.linkname!r}, not a file in the image"
                ) from None
            try:
                if not stat.S_ISREG(os.fstat(tfd).st_mode):
                    raise LayerError(f"hard link {member.name!r} names {member.linkname!r}, not a regular file")
                os.link(f"/proc/self/fd/{tfd}", name, dst_dir_fd=pfd, follow_symlinks=True)
            finally:
                os.close(tfd)
        else:
            src = tar.extractfile(member)
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=pfd)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
                os.fchmod(fd, _mode(member))
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR):
            raise LayerError(f"member {member.name!r} cannot be placed inside the root: {e.strerror}") from None
        raise
    finally:
        os.close(pfd)
