"""Starting bwrap processes: one long-lived spawner thread per process, and the pids cgroups
that bound a sandbox's processes when strop runs as root (RLIMIT_NPROC does not bind for the root
user a sandbox then maps to), created per process, reused per sandbox, and swept when their owner
died (`sweep_dead_cgroups`)."""

import functools
import os
import queue
import shutil
import signal
import subprocess
import threading
import warnings
from pathlib import Path

from strop.env.host.account import as_root, sandbox_account
from strop.env.sandbox.ctty import has_ctty
from strop.env.sandbox.sched_slice import request_short_slice
from strop.lifetime import process_gone


def sweep_dead_cgroups() -> None:
    """Kill what is left in, and remove, the cgroups strop-<pid> of processes that died before their
    exit handlers ran (as root only: no one else has them)."""
    for cg in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")) if os.geteuid() == 0 else ():
        for d in cg.glob("strop-*"):
            pid = d.name.split("-")[1]
            if process_gone(pid):
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


def pids_cgroup_root() -> Path | None:
    """A pids cgroup directory of this process that we may create children in (created here),
    needed only when running as root."""
    if os.geteuid() != 0:
        return None  # RLIMIT_NPROC binds for non-root users; no cgroup needed
    for base in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        if (base / "cgroup.procs").exists() and (
            (base / "pids.max").exists() or base.name == "pids" or "pids" in _read(base / "cgroup.subtree_control")
        ):
            parent = base / f"strop-{os.getpid()}"
            try:
                parent.mkdir(exist_ok=True)
                if (parent / "cgroup.subtree_control").exists():
                    (parent / "cgroup.subtree_control").write_text("+pids")
                return parent
            except OSError:
                continue
    warnings.warn(
        "strop runs as root and no pids cgroup is writable: the sandbox user maps to root, "
        "for whom RLIMIT_NPROC does not apply, so Limits.max_procs is not enforced (run as "
        "a regular user, or make a pids cgroup writable)",
        stacklevel=2,
    )
    return None


class Spawner:
    """Starts every bwrap of this process from one long-lived thread.

    Why a thread of its own: --die-with-parent is PR_SET_PDEATHSIG, which prctl(2) documents as
    firing when the *thread* that started bwrap exits, not the process (this kernel, 6.18, did not
    fire it on thread exit in a test; others may). From a thread that lives as long as the process,
    a sandbox's lifetime is the process's on every kernel, never a pool or executor thread's.

    With a pids cgroup per sandbox (strop runs as root, see pids_cgroup_root; cgroup v1), the
    thread sits in a free sandbox cgroup when it starts bwrap, so bwrap is born inside it: the
    limit holds from the first fork and bwrap's cgroup namespace is rooted there. Moving a thread
    between v1 cgroups waits for an RCU grace period (1-10 ms on a busy machine), so the thread
    stays where it is while that cgroup is free again (a sandbox closed before the next starts:
    no move at all), and cgroups are reused instead of being removed and created per sandbox.

    The thread also requests a short scheduler slice, which bwrap and the sandbox's processes
    inherit (see `strop.env.sandbox.sched_slice`).
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
        request_short_slice()
        while True:
            argv, pass_fds, max_procs, out, done = self._jobs.get()
            try:
                out.append(self._start(argv, pass_fds, max_procs))
            except BaseException as e:  # handed to the caller, who raises it
                out.append(e)
            done.set()

    def _start(
        self, argv: list[str], pass_fds: tuple[int, ...], max_procs: int
    ) -> tuple[subprocess.Popen, Path | None]:
        cgroup = self._cgroup() if self.root is not None else None
        uid, gid = sandbox_account()
        # bwrap runs as the sandbox account (see strop.env.host.node_cache) with an empty environment:
        # it is pid 1 of the sandbox, whose /proc/1/environ every process inside can read. Root drops
        # to that account by exec'ing setpriv, not through Popen's user/group arguments: with those,
        # Python forks instead of vforking, copying this process's page tables with the GIL held
        # (~130 ms for a 3 GiB process here, every engine and rollout thread stopped: the RL loop's
        # process holds the engines' models and caches), where a vfork and one more exec cost ~0.2 ms.
        # A host without setpriv keeps Popen's arguments, and the fork
        setpriv = _setpriv() if as_root() else None
        drop = [setpriv or "setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"] if as_root() else []
        as_account: dict = {"user": uid, "group": gid, "extra_groups": []} if as_root() and not setpriv else {}
        try:
            if cgroup is not None:
                if self._max.get(cgroup) != max_procs:  # reused cgroups keep their limit
                    (cgroup / "pids.max").write_text(str(max_procs + 5))  # + bwrap, server, helpers, this thread
                    self._max[cgroup] = max_procs
                if self._here != cgroup:
                    # cgroup v2 moves whole processes only: a shell joins (as root, who may), then
                    # becomes bwrap under the sandbox account
                    argv = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *drop, *argv]
                    drop, as_account = [], {}
            proc = subprocess.Popen(
                [*drop, *argv] if not as_account else argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=pass_fds,
                start_new_session=has_ctty(),
                bufsize=0,
                env={},
                **as_account,
            )
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


@functools.cache
def _setpriv() -> str | None:
    """The host's setpriv (util-linux), or None."""
    return shutil.which("setpriv", path=os.defpath)


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""
