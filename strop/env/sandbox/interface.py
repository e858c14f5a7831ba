"""The sandbox interface every backend implements: the world an agent acts on, as code drives it.

A sandbox starts from a world image (a read-only system root plus a task repository, mounted
copy-on-write at `WORKDIR`), runs commands with resource limits and a hard wall-clock timeout,
and reports what changed. Bubblewrap (`strop.env.sandbox.bwrap`) is the one backend so far, started
by `strop.env.sandbox.backend.open_sandbox`; another backend implements `Sandbox`.
"""

import math
from dataclasses import dataclass
from typing import Callable, Protocol

WORKDIR = "/home/dev/repo"  # where the repository appears inside the sandbox (the production path)


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
