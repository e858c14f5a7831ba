"""The world an agent acts on: the sandbox interface every backend implements.

A sandbox starts from a world image (a read-only system root plus a task repository, mounted
copy-on-write at `WORKDIR`), runs commands with resource limits and a hard wall-clock timeout,
and reports what changed. Backends (bubblewrap here; containers, microVMs, remote pools later)
plug in behind `open_sandbox`.
"""

import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from strop.env.host_account import cache_dir, hand_over, reachable

WORKDIR = "/home/dev/repo"  # where the repository appears inside the sandbox (the production path)
SCRATCH_KINDS = ("sbx", "world", "check")  # host directories strop-<kind>-<pid>-*, swept when <pid> is dead


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 30  # CPU seconds per command (RLIMIT_CPU)
    memory_mb: int = 1024  # address space per process
    max_procs: int = 64  # processes the sandbox user may hold
    file_size_mb: int = 64  # largest file a command may write
    workspace_mb: int = 256  # total size of the copy-on-write upper layer
    timeout_s: float = 30.0  # default wall-clock limit per command; kills the whole process tree
    output_bytes: int = 65536  # stdout and stderr are each capped at this many bytes

    def __post_init__(self) -> None:
        check_timeout(self.timeout_s)
        for name in ("cpu_s", "memory_mb", "max_procs", "file_size_mb", "workspace_mb", "output_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"sandbox limit {name} must be at least 1, got {getattr(self, name)}")


def check_timeout(seconds: float) -> float:
    """A wall-clock limit must be a positive finite number: `nan <= 0` is false, and a NaN or
    infinite deadline never passes, so either would mean no limit at all."""
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"a timeout must be a positive number of seconds, got {seconds!r}")
    return float(seconds)


@dataclass
class ExecResult:
    exit_code: int  # 124 on timeout, as coreutils `timeout`
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    workspace_exceeded: bool = False  # the copy-on-write layer outgrew Limits.workspace_mb


class Sandbox(Protocol):
    def exec(
        self,
        cmd: str | list[str],
        timeout: float | None = None,
        stdin: str | None = None,
        env: dict[str, str] | None = None,
        on_output: Callable[[int, bytes], None] | None = None,
    ) -> ExecResult:
        """Run `cmd` (a shell string runs under `bash -lc`) in WORKDIR. `on_output(stream, data)`
        (stream 1 or 2), if given, also receives the output as it arrives, within the same cap."""
        ...

    def read_file(self, path: str) -> bytes: ...  # relative paths are relative to WORKDIR
    def write_file(self, path: str, data: bytes | str) -> None: ...
    def remove_file(self, path: str) -> None: ...  # a missing path is not an error
    def list_dir(self, path: str = ".") -> list[str]: ...

    def diff(self) -> dict[str, bytes | None]:
        """Files under WORKDIR that differ from the image: relative path -> new bytes (None = deleted)."""
        ...

    def close(self) -> None:
        """Kill everything still running and delete the copy-on-write layer. Idempotent."""
        ...


def scratch_base() -> Path:
    """Where scratch worlds go: the temp dir, unless the sandbox account cannot enter it (a private
    TMPDIR while strop runs as root), then the node cache's scratch/."""
    base = Path(tempfile.gettempdir())
    if reachable(base):
        return base
    return cache_dir("scratch")


def scratch_dir(kind: str) -> Path:
    """A fresh host directory for a world a sandbox opens (a task's repository, a checker's world),
    named strop-<kind>-<pid>-* in `scratch_base()`, handed to the sandbox account. Its owner removes
    it; when the owner is killed first, the next strop process to start a sandbox removes it (the
    backend's sweep of dead owners')."""
    assert kind in SCRATCH_KINDS, kind
    path = Path(tempfile.mkdtemp(prefix=f"strop-{kind}-{os.getpid()}-", dir=scratch_base()))
    hand_over(path)
    return path


def open_sandbox(world: Path, limits: Limits = Limits(), image: str = "/") -> Sandbox:
    """Start a sandbox whose WORKDIR is a copy-on-write view of the directory `world`.

    `image` is the read-only system root. Bubblewrap is the only backend so far.
    """
    from strop.env.bwrap import BwrapSandbox  # the backend imports this module; import it lazily

    return BwrapSandbox(Path(world), limits, image)
