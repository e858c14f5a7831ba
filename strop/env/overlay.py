"""Host-side access to a live sandbox's files, and the diff of its copy-on-write layer.

File operations go through a directory fd of the sandbox's root (opened from `/proc/<pid>/root`
once the sandbox is fully set up, and held, so a recycled pid can never redirect it), so the host
sees exactly the merged tree the agent sees. Every path is resolved with `openat2(RESOLVE_IN_ROOT)`:
absolute symlinks and `..` planted by the agent stay inside the sandbox root instead of
reaching host files (a plain `open("/proc/<pid>/root/...")` would follow `/etc/shadow` on the
host). The diff reads the overlay upper directory directly (it is a host directory): regular
files are additions or edits, character devices 0:0 are whiteouts (deletions), and an opaque
directory hides everything below it in the image.

Reads and writes refuse anything but regular files (a planted fifo or device cannot block or
flood the host) and reads are bounded. Not covered: special files and xattrs are not reported by
the diff; symlinks are reported as their target path.
"""

import contextlib
import ctypes
import errno
import os
import stat
from pathlib import Path

_SYS_OPENAT2 = 437  # x86_64 and aarch64 share the number
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
_libc = ctypes.CDLL(None, use_errno=True)


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


@contextlib.contextmanager
def acting_as(owner: tuple[int, int] | None):
    """This thread's file operations run as `owner` (uid, gid), when set: the files it creates are
    that account's, and an overlay mounted in a user namespace accepts only owners mapped in it
    (root is not: creating a file as root there fails with EOVERFLOW). setfsuid is per thread."""
    if owner is None:
        yield
        return
    old_gid = _libc.setfsgid(owner[1])  # while still root, who may
    old_uid = _libc.setfsuid(owner[0])
    try:
        yield
    finally:
        _libc.setfsuid(old_uid)
        _libc.setfsgid(old_gid)


class RootView:
    """Read, write and list files under `workdir` as seen from inside the sandbox whose root
    directory is open as `root_fd` (the caller owns the fd). With `owner` (uid, gid), writes and
    deletions run as that account (`acting_as`): the sandbox's user, when strop runs as root."""

    def __init__(self, root_fd: int, workdir: str, owner: tuple[int, int] | None = None):
        self.root_fd, self.workdir, self.owner = root_fd, workdir, owner

    def _abs(self, path: str) -> str:
        return path if path.startswith("/") else f"{self.workdir}/{path}"

    def _rootfd(self) -> int:
        return os.dup(self.root_fd)

    def read(self, path: str, max_bytes: int) -> bytes:
        """Bytes of a regular file of at most `max_bytes`. Anything else raises OSError: a fifo or
        device the agent planted must not block or flood the host (O_NONBLOCK, then fstat)."""
        rfd = self._rootfd()
        try:
            fd = open_in_root(rfd, self._abs(path), os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        finally:
            os.close(rfd)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", path)
        return data

    def write(self, path: str, data: bytes) -> None:
        with acting_as(self.owner):
            self._write(path, data)

    def remove(self, path: str) -> None:
        """Delete the file (or empty directory) at `path`, the lookup confined like every other;
        a missing path is not an error."""
        with acting_as(self.owner):
            self._remove(path)

    def _write(self, path: str, data: bytes) -> None:
        full = self._abs(path)
        parent, _, name = full.rstrip("/").rpartition("/")
        rfd = self._rootfd()
        try:
            pfd = makedirs_in_root(rfd, parent)
            try:
                # the final component is opened confined too (it may be a symlink the agent planted);
                # O_NONBLOCK: a planted fifo fails (ENXIO) instead of blocking
                fd = open_in_root(rfd, full, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY, 0o644)
            finally:
                os.close(pfd)
        finally:
            os.close(rfd)
        with os.fdopen(fd, "wb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            os.set_blocking(fd, True)
            os.ftruncate(fd, 0)
            f.write(data)

    def _remove(self, path: str) -> None:
        full = self._abs(path).rstrip("/")
        parent, _, name = full.rpartition("/")
        rfd = self._rootfd()
        try:
            pfd = open_in_root(rfd, parent or "/", os.O_PATH | os.O_DIRECTORY)
        except FileNotFoundError:
            return
        finally:
            os.close(rfd)
        try:
            try:
                os.unlink(name, dir_fd=pfd)
            except IsADirectoryError:
                os.rmdir(name, dir_fd=pfd)
        except FileNotFoundError:
            pass
        finally:
            os.close(pfd)

    def list(self, path: str) -> list[str]:
        rfd = self._rootfd()
        try:
            fd = open_in_root(rfd, self._abs(path), os.O_RDONLY | os.O_DIRECTORY)
        finally:
            os.close(rfd)
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(path: str) -> bool:
    for name in ("user.overlay.opaque", "trusted.overlay.opaque"):
        try:
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
        except OSError:
            pass
    return False


def _lower_files(lower: Path, rel: str) -> list[str]:
    """Every non-directory path under lower/rel (relative to lower), or rel itself if it is a file."""
    base = lower / rel
    if not base.is_dir() or base.is_symlink():
        return [rel] if os.path.lexists(base) else []
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        for n in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            out.append(os.path.relpath(os.path.join(dirpath, n), lower))
    return out


def _content(path: str) -> bytes | None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return os.fsencode(os.readlink(path))
    if stat.S_ISREG(st.st_mode):
        with open(path, "rb") as f:
            return f.read()
    return None  # fifo, socket, device: not reported


def upper_diff(lower: Path, upper: Path) -> dict[str, bytes | None]:
    """Relative path -> new bytes (None = deleted) for files that differ between lower and lower+upper."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(upper):
        rel_dir = os.path.relpath(dirpath, upper)
        rel_dir = "" if rel_dir == "." else rel_dir
        if rel_dir and _is_opaque(dirpath):
            for f in _lower_files(lower, rel_dir):
                out[f] = None  # overwritten below if the upper layer re-creates it
        for name in filenames + dirnames:
            full = os.path.join(dirpath, name)
            rel = os.path.join(rel_dir, name)
            st = os.lstat(full)
            if _is_whiteout(st):
                for f in _lower_files(lower, rel):
                    out[f] = None
            elif not stat.S_ISDIR(st.st_mode):
                if (lower / rel).is_dir() and not (lower / rel).is_symlink():
                    for f in _lower_files(lower, rel):
                        out[f] = None  # a directory in the image replaced by a file
                new = _content(full)
                if new is not None:
                    out[rel] = new
            elif (lower / rel).exists() and not (lower / rel).is_dir():
                out[rel] = None  # a file in the image replaced by a directory
    # drop copy-ups that changed only metadata, and rewrites to identical bytes
    for rel, new in list(out.items()):
        old = lower / rel
        if new is not None and os.path.lexists(old) and not old.is_dir() and _content(str(old)) == new:
            del out[rel]
        elif new is None and not os.path.lexists(old):
            del out[rel]
    return out


def copy_tree(src: Path, dst: Path) -> None:
    """Copy the directory `src` to a new `dst` without ever following a symlink: links are copied as
    links (inside a sandbox they resolve in its root, not on the host), regular files with their
    permission bits (setuid and setgid dropped), directories; fifos, sockets and devices are skipped.
    `dst` may exist (empty)."""
    os.makedirs(dst, 0o755, exist_ok=True)
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        out = dst if rel == "." else dst / rel
        for name in dirnames + filenames:
            s, d = os.path.join(dirpath, name), out / name
            st = os.lstat(s)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), d)
            elif stat.S_ISDIR(st.st_mode):
                os.mkdir(d, stat.S_IMODE(st.st_mode) & 0o1777 | 0o700)
            elif stat.S_ISREG(st.st_mode):
                fd = os.open(s, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                with os.fdopen(fd, "rb") as fin, open(d, "xb") as fout:
                    while chunk := fin.read(1 << 20):
                        fout.write(chunk)
                os.chmod(d, stat.S_IMODE(st.st_mode) & 0o1777)
        dirnames[:] = [n for n in dirnames if not os.path.islink(os.path.join(dirpath, n))]
