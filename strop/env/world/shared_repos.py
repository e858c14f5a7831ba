"""Ready-made starting repositories, one per content, shared read-only by the sandboxes of a task.

An episode's sandbox, the checker's (the answerer's, twice when the episode paid) and the judge's
(an empty world) each mount a task's starting repository as the lower layer of their overlay. Made
for each sandbox, it was written, handed to the sandbox account and removed every time: on a disk
the removal alone waits ~10 ms for three small files, more than bwrap's start. Here it is made once
per content (the files, the checkout it starts from, the start patch) and shared by every sandbox
of that content while any is open, then kept for the next (`KEPT` copies and `KEPT_BYTES` bytes of
unused ones, the least recently used removed first), and removed at exit.

Sharing changes nothing a sandbox can see: the copy is the lower layer of each overlay, which no
sandbox writes (writes go to its own upper layer, `strop.env.sandbox.bwrap`), it is never mounted
itself nor visible inside (strop's scratch directories are not, `strop.env.sandbox.layout`), and
host code only reads it. A check still starts from the pristine repository.
"""

import atexit
import contextlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from strop.confined import rmtree, walk
from strop.env.host.account import hand_over
from strop.env.host.scratch import scratch_dir

KEPT = 512  # unused copies kept for the next sandbox of their task (a synthetic task's is a few KiB)
KEPT_BYTES = 256 << 20  # and at most this many bytes of files in them (a copy of a real checkout is larger)


@dataclass
class _Copy:
    users: int = 0
    path: Path | None = None  # the scratch directory holding `repo`, once made
    size: int = 0
    made: threading.Lock = field(default_factory=threading.Lock)  # held while the first user makes it


class SharedRepositories:
    """The copies this process made (see the module docstring); safe to use from threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._copies: OrderedDict[str, _Copy] = OrderedDict()  # least recently used first

    @contextlib.contextmanager
    def use(self, key: str, make: Callable[[Path], None]) -> Iterator[Path]:
        """The repository named `key` (what decides its content), made by `make(directory)` in a
        new directory unless a copy exists; not to be written, and kept until the block exits."""
        copy = self._acquire(key, make)
        try:
            yield copy.path / "repo"
        finally:
            with self._lock:
                copy.users -= 1
            self._evict(KEPT, KEPT_BYTES)

    def clear(self, in_use: bool = False) -> None:
        """Remove every copy no sandbox uses, and with `in_use` the others too (at exit, once the
        sandboxes are closed: `strop.env.sandbox.host_state` closes them first)."""
        self._evict(0, 0, in_use)

    def after_fork_in_child(self) -> None:
        """A forked child makes copies of its own: its parent removes the parent's."""
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self._copies = OrderedDict()

    def _acquire(self, key: str, make: Callable[[Path], None]) -> _Copy:
        with self._lock:
            copy = self._copies.setdefault(key, _Copy())
            copy.users += 1
            self._copies.move_to_end(key)
        try:
            with copy.made:  # the first user makes it; the others wait for it
                if copy.path is None:
                    path = scratch_dir("world")
                    try:
                        make(path / "repo")
                        hand_over(path)
                    except BaseException:
                        rmtree(path)
                        raise
                    copy.path, copy.size = path, _size(path)
        except BaseException:
            with self._lock:
                copy.users -= 1
            self._evict(KEPT, KEPT_BYTES)
            raise
        return copy

    def _evict(self, kept: int, kept_bytes: int, in_use: bool = False) -> None:
        """Remove the least recently used unused copies (any with `in_use`) until at most `kept` of
        them, holding at most `kept_bytes`, are left."""
        gone = []
        with self._lock:
            unused = [(k, c) for k, c in self._copies.items() if c.users == 0 or in_use]
            size = sum(c.size for _, c in unused)
            for key, copy in unused:  # oldest first
                if len(unused) - len(gone) <= kept and size <= kept_bytes:
                    break
                del self._copies[key]
                size -= copy.size
                gone.append(copy)
        for copy in gone:  # outside the lock: a removal on a disk waits for it
            if copy.path is not None:
                rmtree(copy.path)


SHARED = SharedRepositories()
atexit.register(SHARED.clear, in_use=True)
os.register_at_fork(after_in_child=SHARED.after_fork_in_child)


def _size(path: Path) -> int:
    return sum(os.lstat(os.path.join(d, n)).st_size for d, _, names in walk(path) for n in names)
