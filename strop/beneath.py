"""Files inside a directory strop was handed, reached without following symbolic links: what
`strop agent` reads for its diff and writes with `--apply`, and what `strop tasks export` writes,
so that a link inside the directory (planted, or the user's own) never takes a read or a write out
of it.

A path is relative, with no `.`, `..` or empty parts, and is opened one component at a time from a
descriptor of the directory with `O_NOFOLLOW` (openat), so a link at any level, or one swapped in
between the check and the write, makes the operation fail rather than be followed. Writes go to
regular files only. `apply_changes` checks every path before it writes any: a change set it
refuses leaves the directory as it was.
"""

import errno
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from strop.errors import UserError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def parts_of(rel: str) -> list[str]:
    """The components of the relative path `rel`, or UserError: absolute, empty, `.`/`..`, NUL."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\0" in rel or any(p in ("", ".", "..") for p in parts):
        raise UserError(f"{rel!r} is not a plain relative path")
    return parts


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None


def _walk(root_fd: int, dirs: list[str], create: bool) -> int | None:
    """A descriptor of root/dirs (the caller closes it), each component opened without following a
    link; None when one is missing and not `create`d."""
    fd = os.dup(root_fd)
    try:
        for part in dirs:
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    os.close(fd)
                    return None
                os.mkdir(part, 0o755, dir_fd=fd)
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_beneath(root: Path, rel: str) -> bytes | None:
    """What `rel` under `root` holds: a regular file's bytes, a symbolic link's target path (as the
    sandbox's diff reports a link), or None when it is absent, something else, or reached only
    through a link."""
    parts = parts_of(rel)
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = _walk(root_fd, parts[:-1], create=False)
    except OSError:  # a component is a link or a file
        return None
    finally:
        os.close(root_fd)
    if fd is None:
        return None
    try:
        st = _lstat(fd, parts[-1])
        if st is not None and stat.S_ISLNK(st.st_mode):
            return os.fsencode(os.readlink(parts[-1], dir_fd=fd))
        if st is None or not stat.S_ISREG(st.st_mode):
            return None
        ffd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        with os.fdopen(ffd, "rb") as f:
            return f.read() if stat.S_ISREG(os.fstat(ffd).st_mode) else None
    finally:
        os.close(fd)


def _check(root_fd: int, rel: str, deleted: set[str]) -> None:
    """UserError unless the change of `rel` can be made beneath root without following a link:
    every existing parent a real directory (or a file or link the change set deletes first), the
    target absent, a regular file, or a link (removed itself, or replaced by the written file)."""
    parts = parts_of(rel)
    fd = os.dup(root_fd)
    try:
        for i, part in enumerate(parts):
            here = "/".join(parts[: i + 1])
            st = _lstat(fd, part)
            if i == len(parts) - 1:
                if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                    kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
                    raise UserError(f"{rel!r} is {kind}")
                return
            if st is None or (here in deleted and not stat.S_ISDIR(st.st_mode)):
                return  # made afresh below here
            if stat.S_ISLNK(st.st_mode):
                raise UserError(f"{rel!r}: {here!r} is a symbolic link; not writing through it")
            if not stat.S_ISDIR(st.st_mode):
                raise UserError(f"{rel!r}: {here!r} is not a directory")
            nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)


def apply_changes(root: Path, changes: Mapping[str, bytes | str | None]) -> None:
    """Make `changes` (relative path -> new bytes, str as UTF-8, or None = delete) under the
    directory `root`: every path is checked first (UserError, nothing written), then deletions
    (a link is removed itself, never its target), then writes (missing directories made), each
    opened relative to its parent's descriptor without following a link."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        deleted = {rel for rel, data in changes.items() if data is None}
        written = set(changes) - deleted
        for rel in changes:
            _check(root_fd, rel, deleted)
            above = ["/".join(parts_of(rel)[:i]) for i in range(1, rel.count("/") + 1)]
            if written.intersection(above):
                raise UserError(f"{rel!r}: {written.intersection(above).pop()!r} is written as a file")
        try:
            for rel in sorted(deleted):
                _delete(root_fd, parts_of(rel))
            for rel, data in sorted(changes.items()):
                if data is not None:
                    _write(root_fd, parts_of(rel), data.encode() if isinstance(data, str) else data)
        except OSError as e:  # a link or file swapped in after the check: refused, not followed
            raise UserError(f"{root}: {e.filename or ''}: {e.strerror} (changed while being written)") from None
    finally:
        os.close(root_fd)


def _delete(root_fd: int, parts: list[str]) -> None:
    fd = _walk(root_fd, parts[:-1], create=False)
    if fd is None:
        return
    try:
        st = _lstat(fd, parts[-1])
        if st is not None and not stat.S_ISDIR(st.st_mode):
            os.unlink(parts[-1], dir_fd=fd)
    finally:
        os.close(fd)


def _write(root_fd: int, parts: list[str], data: bytes) -> None:
    fd = _walk(root_fd, parts[:-1], create=True)
    try:
        st = _lstat(fd, parts[-1])
        if st is not None and stat.S_ISLNK(st.st_mode):
            os.unlink(parts[-1], dir_fd=fd)  # replaced by the file, as in the sandbox
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        ffd = os.open(parts[-1], flags, 0o644, dir_fd=fd)
    finally:
        os.close(fd)
    with os.fdopen(ffd, "wb") as f:
        if not stat.S_ISREG(os.fstat(ffd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", "/".join(parts))
        os.set_blocking(ffd, True)
        os.ftruncate(ffd, 0)
        f.write(data)
