"""An engine server in a child process that this process owns: started on a port it picked,
waited on until it answers, and stopped with nothing left running.

The child runs in its own process group (a server may spawn workers of its own, as vLLM does
for its engine core), so `close` ends the whole group: SIGTERM, then SIGKILL after a grace
period. Its output goes to a log file whose tail is quoted when it fails to start.
"""

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

STOP_GRACE_S = 10.0  # a server that has not exited this long after SIGTERM is killed


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's pick); the child binds it moments later."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`argv` run as a server; `{port}` in it is replaced by the port picked. `health` is the path
    that answers 200 once it serves. `log_path`: where its output goes (default: a temporary
    file, removed at close)."""

    def __init__(
        self,
        argv: list[str],
        log_path: str | Path | None = None,
        *,
        health: str = "/health",
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        start_timeout_s: float = 600.0,
    ):
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self._own_log = log_path is None  # a temporary log, removed at close
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="strop-server-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self._health = health
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [a.replace("{port}", str(self.port)) for a in argv],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + self._health, timeout=5) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"engine server exited with status {self.proc.returncode} before serving; "
                    f"its log ({self.log_path}) ends:\n{self.log_tail()}"
                )
            if self.healthy():
                return
            time.sleep(0.5)
        raise TimeoutError(
            f"engine server did not answer {self._health} within {timeout_s:.0f} s; "
            f"its log ({self.log_path}) ends:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        """Stop the server and every process it started (its process group)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        try:  # children that outlived the leader (already reaped) still carry its group id
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
        if self._own_log:
            self.log_path.unlink(missing_ok=True)
