"""Files inside a directory, reached so that no symbolic link in it takes a read or a write out of
it: the one home of strop's "open beneath a directory" needs.

Two ways, for two kinds of directory:
- beneath (`read_beneath`, `open_beneath`, `lstat_beneath`, `apply_changes`, `read_regular`,
  `write_new`, `open_append`, `copy_tree`, `walk`, `rmtree`): a link is never followed. For
  directories a user handed strop (what `strop agent` reads for its diff and writes with `--apply`,
  what `strop tasks export` writes), files it names (a session log), trees strop copies (a
  repository's checkout, an agent's workspace) and what a sandbox's code leaves (walked and removed
  without recursion: it may nest thousands deep).
- in a root (`open_in_root`, `makedirs_in_root`): a link resolves as it would for a process whose
  root is that directory (openat2 with RESOLVE_IN_ROOT): an absolute link or `..` stays inside. For
  a sandbox's root, an unpacked image and its layers.

Beneath, a path is relative, with no `.`, `..` or empty parts, and is opened one component at a time from a
descriptor of the directory with `O_NOFOLLOW` (openat), so a link at any level, or one swapped in
between the check and the write, makes the operation fail rather than be followed. Writes go to
regular files only. `apply_changes` checks every path before it writes any: a change set it
refuses leaves the directory as it was.
"""

import ctypes
import errno
import fnmatch
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

from strop.errors import UserError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPENAT2 = 437  # x86_64 and aarch64 share the number
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10


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


def _parent_beneath(root: Path, rel: str) -> tuple[int | None, str]:
    """(a descriptor of the directory holding `rel` under `root`, which the caller closes, or None when
    it is missing or reached only through a link; `rel`'s last name)."""
    parts = parts_of(rel)
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _walk(root_fd, parts[:-1], create=False), parts[-1]
    except OSError:  # a component is a link or a file
        return None, parts[-1]
    finally:
        os.close(root_fd)


def read_beneath(root: Path, rel: str, links: bool = True) -> bytes | None:
    """What `rel` under `root` holds: a regular file's bytes, a symbolic link's target path (as the
    sandbox's diff reports a link; None with `links=False`), or None when it is absent, something
    else, or reached only through a link."""
    fd, name = _parent_beneath(root, rel)
    if fd is None:
        return None
    try:
        st = _lstat(fd, name)
        if st is not None and stat.S_ISLNK(st.st_mode):
            return os.fsencode(os.readlink(name, dir_fd=fd)) if links else None
        return read_regular(name, fd) if st is not None and stat.S_ISREG(st.st_mode) else None
    finally:
        os.close(fd)


def lstat_beneath(root: Path, rel: str) -> os.stat_result | None:
    """The lstat of `rel` under `root` (a symbolic link's own), or None when it is absent or reached
    only through a link."""
    fd, name = _parent_beneath(root, rel)
    if fd is None:
        return None
    try:
        return _lstat(fd, name)
    finally:
        os.close(fd)


def open_beneath(root: Path, rel: str) -> BinaryIO:
    """The regular file `rel` under `root`, open for reading, reached without following a link;
    OSError when it is missing, reached through a link, or not a regular file (a fifo or a device
    is not read: O_NONBLOCK, then fstat)."""
    fd, name = _parent_beneath(root, rel)
    if fd is None:
        raise FileNotFoundError(errno.ENOENT, "missing, or reached through a link", rel)
    try:
        ffd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(ffd).st_mode):
        os.close(ffd)
        raise OSError(errno.EINVAL, "not a regular file", rel)
    os.set_blocking(ffd, True)
    return os.fdopen(ffd, "rb")


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


def read_regular(name: str | Path, dir_fd: int | None = None, max_bytes: int = -1) -> bytes | None:
    """The bytes (at most `max_bytes`; -1: all) of the regular file `name` (relative to `dir_fd` when
    given), or None when it is missing, a symbolic link (O_NOFOLLOW: never followed) or not a
    regular file (a fifo is not waited on: O_NONBLOCK)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(max_bytes) if stat.S_ISREG(os.fstat(fd).st_mode) else None


def write_new(path: Path, data: bytes) -> None:
    """Create the file `path` holding `data`; OSError when anything is at its name already, a
    symbolic link included (O_EXCL: nothing is overwritten or written through)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def open_append(path: str | Path, what: str) -> int:
    """A descriptor appending to the regular file `path` (created when missing), for a log a user
    named (`what`: the flag, in errors). UserError in one line when `path` is a symbolic link
    (O_NOFOLLOW: never written through), a directory, or anything but a regular file (a fifo is not
    waited on: O_NONBLOCK)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        why = {
            errno.ELOOP: "is a symbolic link; strop does not write through one",
            errno.EISDIR: "is a directory; name a file to append to",
            errno.ENOENT: "is in a directory that does not exist",
        }.get(e.errno, f"cannot be opened ({e.strerror})")
        raise UserError(f"{what} {str(path)!r} {why}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"{what} {str(path)!r} is not a regular file")
    return fd


def copy_tree(src: Path, dst: Path, ignore: tuple[str, ...] = ()) -> None:
    """Copy the directory `src` to a new `dst` without ever following a symlink: links are copied as
    links (inside a sandbox they resolve in its root, not on the host), regular files with their
    permission bits (setuid and setgid dropped), directories; fifos, sockets and devices are skipped,
    and so are names matching an `ignore` glob and files strop may not read (unreadable to the
    sandbox's user as well). `dst` may exist (empty)."""
    os.makedirs(dst, 0o755, exist_ok=True)
    for dirpath, dirnames, filenames in walk(src):
        rel = os.path.relpath(dirpath, src)
        out = dst if rel == "." else dst / rel
        dirnames[:] = [n for n in dirnames if not any(fnmatch.fnmatch(n, g) for g in ignore)]
        for name in dirnames + [n for n in filenames if not any(fnmatch.fnmatch(n, g) for g in ignore)]:
            s, d = os.path.join(dirpath, name), out / name
            st = os.lstat(s)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), d)
            elif stat.S_ISDIR(st.st_mode):
                os.mkdir(d, stat.S_IMODE(st.st_mode) & 0o1777 | 0o700)
            elif stat.S_ISREG(st.st_mode):
                try:
                    fd = os.open(s, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                except PermissionError:
                    continue
                with os.fdopen(fd, "rb") as fin, open(d, "xb") as fout:
                    while chunk := fin.read(1 << 20):
                        fout.write(chunk)
                os.chmod(d, stat.S_IMODE(st.st_mode) & 0o1777)
        dirnames[:] = [n for n in dirnames if not os.path.islink(os.path.join(dirpath, n))]


def walk(top: str | Path) -> Iterator[tuple[str, list[str], list[str]]]:
    """`os.walk(top)`: (dirpath, dirnames, filenames) top-down, `dirnames` prunable in place, links
    listed (a link to a directory among `dirnames`) but never followed, unreadable directories
    left out; without recursion, so a tree nested deeper than Python's recursion limit (a sandbox's
    code can leave one) is walked like any other (this Python's os.walk recurses)."""
    stack = [os.fspath(top)]
    while stack:
        here = stack.pop()
        try:
            with os.scandir(here) as it:
                entries = list(it)
        except OSError:
            continue
        dirnames, filenames = [], []
        for e in entries:
            try:
                is_dir = e.is_dir()
            except OSError:
                is_dir = False
            (dirnames if is_dir else filenames).append(e.name)
        yield here, dirnames, filenames
        for name in reversed(dirnames):
            path = os.path.join(here, name)
            if not os.path.islink(path):
                stack.append(path)


def _open_dir(parent: int, name: str) -> int:
    """A descriptor of the directory `name` in `parent`, never through a link; one that may not be
    entered (overlay's work dir is mode 000) is made enterable first."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except PermissionError:
        pfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            os.chmod(f"/proc/self/fd/{pfd}", 0o700)  # chmod of an O_PATH descriptor, through /proc
        finally:
            os.close(pfd)
        return os.open(name, _DIR_FLAGS, dir_fd=parent)


def _remove_at(op: Callable[..., None], name: str, dir_fd: int) -> None:
    """`op(name, dir_fd=dir_fd)` (unlink or rmdir), making the directory writable first if it is
    not; what is already gone is not an error."""
    try:
        op(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except PermissionError:
        os.chmod(f"/proc/self/fd/{dir_fd}", 0o700)
        op(name, dir_fd=dir_fd)


def rmtree(path: str | Path, dir_fd: int | None = None) -> None:
    """Remove `path` (a directory tree, or a file or link itself; a name in the directory `dir_fd`
    when given) without following a link inside it, making unwritable directories writable on the
    way, and with one directory open at a time and no recursion: a sandbox's code can leave a tree
    nested deeper than Python's recursion limit, the descriptor limit and PATH_MAX. Each step up is
    checked to reach the directory it came from. What another process removes meanwhile is not an
    error."""
    path = Path(path)
    try:
        fd = os.dup(dir_fd) if dir_fd is not None else os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    name = str(path) if dir_fd is not None else path.name
    # one level per directory entered: (its name in its parent, the parent's identity, subdirectories left)
    stack: list[tuple[str, tuple[int, int], list[str]]] = [("", (0, 0), [name])]
    try:
        st = _lstat(fd, name)
        if st is None:
            return
        if not stat.S_ISDIR(st.st_mode):
            _remove_at(os.unlink, name, fd)
            return
        while True:
            name, parent_id, pending = stack[-1]
            if pending:
                child = pending.pop()
                try:
                    cfd = _open_dir(fd, child)
                except FileNotFoundError:
                    continue
                here = os.fstat(fd)
                os.close(fd)
                fd, subdirs = cfd, []
                with os.scandir(fd) as it:
                    entries = list(it)
                for e in entries:
                    if e.is_dir(follow_symlinks=False):
                        subdirs.append(e.name)
                    else:
                        _remove_at(os.unlink, e.name, fd)
                stack.append((child, (here.st_dev, here.st_ino), subdirs))
                continue
            stack.pop()
            if not stack:
                return
            up = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            st = os.fstat(up)
            os.close(fd)
            fd = up
            if (st.st_dev, st.st_ino) != parent_id:
                raise OSError(errno.EXDEV, "moved while being removed", str(path))
            _remove_at(os.rmdir, name, fd)
    finally:
        os.close(fd)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_in_root(root_fd: int, path: str, flags: int, mode: int = 0o644) -> int:
    """openat2(root_fd, path) with the lookup confined to the tree under root_fd."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(_SYS_OPENAT2, root_fd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def makedirs_in_root(root_fd: int, path: str) -> int:
    """Create the missing directories of `path` under root_fd and return an O_PATH fd of the last
    (root_fd's own directory for "" or "/"). Every prefix is looked up from root_fd, confined to it,
    so a symlink on the way resolves inside that root; one that dangles raises NotADirectoryError."""
    parts = [p for p in path.split("/") if p]
    for i in range(len(parts)):
        prefix = "/".join(parts[: i + 1])
        try:
            os.close(open_in_root(root_fd, prefix, os.O_PATH | os.O_DIRECTORY))
        except FileNotFoundError:
            pfd = open_in_root(root_fd, "/".join(parts[:i]) or "/", os.O_PATH | os.O_DIRECTORY)
            try:
                os.mkdir(parts[i], 0o755, dir_fd=pfd)
            except FileExistsError:  # a dangling symlink: its target is not ours to invent
                raise NotADirectoryError(errno.ENOTDIR, "a symlink on the way dangles", prefix) from None
            finally:
                os.close(pfd)
    return open_in_root(root_fd, "/".join(parts) or "/", os.O_PATH | os.O_DIRECTORY)
