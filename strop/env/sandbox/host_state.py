"""This process's sandbox state, owned by one object (`HOST`), and what dead processes left behind.

`HOST` holds, per image, the temp root the sandboxes' copy-on-write layers live under and the
files their mounts share (`strop.env.sandbox.layout.prepare_root`), made on the first sandbox of
that image; the spawner thread and its pids cgroups (`strop.env.sandbox.spawner`); and the open
sandboxes, which it closes at exit when their owner did not, before removing the temp roots and
cgroups. A forked child gets a spawner (and a cgroup root named after it) of its own on first use:
the parent's thread does not exist in it.

The first sandbox of an image also sweeps what processes killed before their exit handlers ran
left behind (`strop.env.host.scratch.sweep_dead`, and their pids cgroups).
"""

import atexit
import os
import tempfile
import threading
import weakref
from pathlib import Path

from strop.confined import rmtree
from strop.env.host.scratch import scratch_base, sweep_dead
from strop.env.sandbox.layout import ImageRoot, prepare_root
from strop.env.sandbox.spawner import Spawner, pids_cgroup_root, sweep_dead_cgroups


class SandboxHost:
    """The state every sandbox of this process shares (see the module docstring)."""

    def __init__(self):
        self._lock = threading.RLock()
        self._images: dict[str, ImageRoot] = {}
        self._open: weakref.WeakSet = weakref.WeakSet()  # closed at exit if the caller did not
        self._spawner: Spawner | None = None
        self._cgroup_root: Path | None = None
        self._cgroup_checked = False

    def image(self, image: str = "/") -> ImageRoot:
        """The shared files of `image`'s sandboxes, made on first use."""
        with self._lock:
            if image not in self._images:
                self._images[image] = self._prepare(image)
            return self._images[image]

    def spawner(self) -> Spawner:
        """The thread that starts every bwrap of this process, started on first use."""
        with self._lock:
            if self._spawner is None:
                self._spawner = Spawner(self._pids_cgroup_root())
            return self._spawner

    def track(self, sandbox) -> None:
        """Close `sandbox` at exit if it is still open then."""
        self._open.add(sandbox)

    def after_fork_in_child(self) -> None:
        """A forked child has no spawner thread, and its cgroup root is named after its parent:
        start those afresh (the temp roots and open sandboxes stay the parent's)."""
        self._lock = threading.RLock()  # another thread may have held it at the fork
        self._spawner, self._cgroup_root, self._cgroup_checked = None, None, False

    def _pids_cgroup_root(self) -> Path | None:
        if not self._cgroup_checked:
            self._cgroup_root, self._cgroup_checked = pids_cgroup_root(), True
        return self._cgroup_root

    def _prepare(self, image: str) -> ImageRoot:
        if not (Path(image) / "usr").is_dir() or not (Path(image) / "etc").is_dir():
            raise ValueError(f"image {image} is not a system root (no /usr or /etc)")
        base = Path(temp_base() or tempfile.gettempdir())
        sweep_dead(*{base, Path(tempfile.gettempdir()), scratch_base()})
        sweep_dead_cgroups()
        # registered before the root exists: a SIGTERM that lands between its creation and a
        # registration after it would leave it behind (seen in `tests/test_scratch_leaks.py`)
        atexit.register(self._cleanup, base, os.getpid())
        root = Path(tempfile.mkdtemp(prefix=f"strop-sbx-{os.getpid()}-", dir=base))  # swept as scratch is
        os.chmod(root, 0o755)
        self._pids_cgroup_root()
        return prepare_root(image, root)

    def _cleanup(self, base: Path, pid: int) -> None:
        """At exit: kill the sandboxes still open, remove the process's temp roots in `base`
        (strop-sbx-<pid>-*) and its cgroups."""
        for sb in list(self._open):
            sb.close()
        for root in base.glob(f"strop-sbx-{pid}-*"):
            rmtree(root)
        self.spawner().remove_cgroups()


HOST = SandboxHost()
os.register_at_fork(after_in_child=HOST.after_fork_in_child)


def temp_base() -> str | None:
    """Where copy-on-write layers live: STROP_SANDBOX_TMP, else /dev/shm (a tmpfs: overlay setup and
    teardown are several ms faster than on a journaling disk), else the default temp dir."""
    if "STROP_SANDBOX_TMP" in os.environ:
        return os.environ["STROP_SANDBOX_TMP"]
    return "/dev/shm" if os.path.ismount("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
