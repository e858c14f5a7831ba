"""Unpacking a tar layer (an OCI or Docker image layer, a root filesystem tarball, a repository
tarball) into a directory, safely, with OCI whiteouts honoured.

Every path is resolved by the kernel inside the target (`openat2` with RESOLVE_IN_ROOT, see
`strop.confined.open_in_root`): an absolute symlink in an image points inside the image, as it
will inside a sandbox, and no member can reach the host through `..`, an absolute name or a
symlink planted by an earlier member or layer. Names with a `..` component are refused outright
(no real image has them). Hard links must name a regular file inside the target. Device nodes,
fifos and sockets are skipped (a sandbox gets a fresh /dev), setuid and setgid bits dropped, and
owners not kept (the unpacking account owns every file): a layer carries no privilege.

Bounded: one image (all its layers, one `Budget`) unpacks to at most `BOUNDS.max_bytes` and
`max_files` entries, to at most `max_ratio` times the bytes it read once past `ratio_floor` (a
gzip or zstd bomb expands thousands of times; real layers a few times), within `max_seconds`.
Anything a hostile layer does wrong, a whiteout of `..` or under a file included, is a `LayerError`
naming the member: one line for the user, never a traceback.

Why not a tool: umoci and skopeo (Debian packages) need root to install and a Go runtime, and the
standard library's tar filters on this Python (3.11.7) have known bypasses (CVE-2025-4517) and
refuse the absolute symlinks every Debian image holds; `tarfile` here only parses, the kernel confines.
"""

import gzip
import io
import lzma
import os
import stat
import tarfile
import time
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


@dataclass(frozen=True)
class Bounds:
    """How much one image may unpack to (see the module docstring)."""

    max_bytes: int = 64 << 30
    max_files: int = 4_000_000
    max_ratio: int = 200
    ratio_floor: int = 256 << 20
    max_seconds: float = 3600.0


BOUNDS = Bounds()


class Budget:
    """What one image has unpacked so far against its bounds (`BOUNDS` unless given): bytes
    written, bytes read from the (compressed) layers, entries made, time."""

    def __init__(self, bounds: Bounds | None = None):
        bounds = bounds or BOUNDS
        self.bounds, self.written, self.read, self.entries = bounds, 0, 0, 0
        self.deadline = time.monotonic() + bounds.max_seconds

    def charge(self, written: int = 0, entries: int = 0) -> None:
        """Count `written` bytes and `entries` more; LayerError past a bound."""
        self.written += written
        self.entries += entries
        b = self.bounds
        if self.written > b.max_bytes:
            raise LayerError(f"unpacks to more than {b.max_bytes >> 30} GiB")
        if self.entries > b.max_files:
            raise LayerError(f"holds more than {b.max_files} entries")
        if self.written > max(b.ratio_floor, b.max_ratio * self.read):
            raise LayerError(
                f"expands more than {b.max_ratio} times ({self.written >> 20} MiB from {self.read >> 20} MiB read):"
                " a decompression bomb"
            )
        if time.monotonic() > self.deadline:
            raise LayerError(f"took longer than {b.max_seconds:.0f} s to unpack")


class _Counted(io.RawIOBase):
    """A reader that charges what passes through to a budget's bytes read."""

    def __init__(self, f: IO[bytes], budget: Budget):
        self.f, self.budget = f, budget

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        self.budget.read += n
        return n


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


def extract_layer(f: IO[bytes], root_fd: int, budget: Budget | None = None) -> LayerStats:
    """Apply one layer read from `f` to the tree whose root directory is open as `root_fd`, within
    `budget` (the image's: shared by its layers; a fresh one by default)."""
    budget = budget or Budget()
    stats = LayerStats()
    member = None
    try:
        with open_layer(io.BufferedReader(_Counted(f, budget), 1 << 20)) as tar:
            for member in tar:
                budget.charge(entries=1)
                _apply(tar, member, root_fd, stats, budget)
    except LayerError:
        raise
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error, lzma.LZMAError, zstandard.ZstdError) as e:
        raise LayerError(f"corrupt or truncated layer: {e}") from None
    except (OSError, ValueError, OverflowError) as e:  # a hostile member the checks above did not foresee
        what = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise LayerError(f"member {member.name if member else '?'!r} cannot be unpacked: {what}") from None
    return stats


def _apply(tar: tarfile.TarFile, member: tarfile.TarInfo, root_fd: int, stats: LayerStats, budget: Budget) -> None:
    path = _member_path(member.name)
    if not path:
        return  # the root itself
    base = path.rpartition("/")[2]
    if base == OPAQUE or base.startswith(WHITEOUT):
        stats.whiteouts += 1
        if base != OPAQUE and base[len(WHITEOUT) :] in ("", ".", ".."):
            raise LayerError(f"whiteout {member.name!r} names no entry")
        parent = path.rpartition("/")[0]
        try:
            mfd = makedirs_in_root(root_fd, parent)
        except (NotADirectoryError, FileExistsError) as e:
            raise LayerError(f"whiteout {member.name!r} cannot be placed inside the root: {e.strerror}") from None
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
                while chunk := src.read(1 << 20):
                    budget.charge(written=len(chunk))
                    out.write(chunk)
                os.fchmod(fd, _mode(member))
    except OSError as e:
        raise LayerError(f"member {member.name!r} cannot be placed inside the root: {e.strerror}") from None
    finally:
        os.close(pfd)
