"""A pool of warm sandboxes for one repository directory: start-up happens in the background, ahead of demand,
and a semaphore bounds how many sandboxes are handed out at once.

Every sandbox handed out is fresh (never reused: a used one holds the previous episode's
changes); a returned one is closed by the pool's worker thread, off the caller's path.

Not covered: one repository per pool (a rollout worker serving many tasks keeps one pool per repository,
or opens sandboxes directly); warm sandboxes hold memory (~0.25 MiB PSS plus ~1.3 MiB of kernel
memory each, see `strop bench sandbox`), so keep `warm` small.
"""

import queue
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from strop.env.sandbox.backend import open_sandbox
from strop.env.sandbox.interface import Limits, Sandbox


class SandboxPool:
    def __init__(
        self, repo_dir: Path, limits: Limits = Limits(), image: str = "/", warm: int = 2, max_active: int = 64
    ):
        assert warm >= 0 and max_active >= 1
        self.repo_dir, self.limits, self.image = Path(repo_dir), limits, image
        self._slots = threading.BoundedSemaphore(max_active)
        self._ready: queue.Queue[Sandbox] = queue.Queue()
        self._todo: queue.Queue[Sandbox | None] = queue.Queue()  # sandboxes to close; None = start one
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="sandbox-pool", daemon=True)
        self._worker.start()
        for _ in range(warm):
            self._todo.put(None)

    def _start(self) -> Sandbox:
        sb = open_sandbox(self.repo_dir, self.limits, self.image)
        sb.exec(["true"])  # wait until it is fully set up, so acquire() hands out a ready one
        return sb

    def _work(self) -> None:
        while (item := self._todo.get()) is not None or not self._closed:
            if item is None:
                if not self._closed:
                    self._ready.put(self._start())
            else:
                item.close()
        while not self._todo.empty():  # close what was returned after close() began
            if (item := self._todo.get()) is not None:
                item.close()

    def acquire(self, timeout: float | None = None) -> Sandbox:
        """A fresh, started sandbox; blocks while `max_active` are out (raises TimeoutError after `timeout`)."""
        assert not self._closed, "pool is closed"
        if not self._slots.acquire(timeout=timeout):
            raise TimeoutError(f"no sandbox slot free within {timeout} s")
        try:
            sb = self._ready.get_nowait()
        except queue.Empty:
            sb = self._start()  # the pool fell behind demand: start one on the caller's thread
        self._todo.put(None)  # replace it in the background
        return sb

    def release(self, sb: Sandbox) -> None:
        """Give a sandbox back; it is closed in the background and its slot freed now."""
        self._todo.put(sb)
        self._slots.release()

    @contextmanager
    def sandbox(self, timeout: float | None = None) -> Iterator[Sandbox]:
        sb = self.acquire(timeout)
        try:
            yield sb
        finally:
            self.release(sb)

    def close(self) -> None:
        """Close the warm sandboxes and those returned; waits for the worker. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._todo.put(None)  # wake the worker
        self._worker.join()
        while not self._ready.empty():
            self._ready.get_nowait().close()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
