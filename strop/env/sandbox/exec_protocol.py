"""The exec protocol between the host and a sandbox's `/bin/sh` server (see `strop.env.sandbox.bwrap`).

The host writes one shell line per exec to the server's stdin (`command_script`): it runs the
target in a subshell with stdin from /dev/null (or the given data) and rlimits set by `ulimit`
(CPU s, address space, file size, process count), then kills every other process in the sandbox
(`kill -9 -1` from the server: background jobs do not outlive their command) and prints a random
per-command marker with the exit code on stdout and stderr. The host reads both pipes with a
bounded buffer until the markers arrive (`collect`).
"""

import os
import select
import shlex
import subprocess
import time
from typing import Callable

from strop.env.sandbox.interface import WORKDIR, Limits

CHECK_EVERY_S = 0.2  # workspace-size poll period while a command runs


def command_script(
    cmd: str | list[str], stdin: str | None, env: dict[str, str] | None, nonce: str, lim: Limits
) -> bytes:
    """The line the server runs for one exec of `cmd` (a string runs under `bash -lc`), ending in
    the two markers that carry `nonce`."""
    # dash's ulimit takes one limit per call; -f counts 512-byte blocks, -v KiB
    ulimit = (
        f"ulimit -t {lim.cpu_s} && ulimit -v {lim.memory_mb * 1024} && "
        f"ulimit -f {lim.file_size_mb * 2048} && ulimit -p {lim.max_procs}"
    )
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
    return (
        f"{line}\n_rc=$?; kill -9 -1 2>/dev/null; printf '\\036{nonce}\\n' >&2; printf '\\036{nonce}:%d\\n' $_rc\n"
    ).encode()


def collect(
    proc: subprocess.Popen,
    nonce: str,
    deadline: float,
    cap: int,
    over_workspace: Callable[[], bool],
    kill: Callable[[], None],
    on_output: Callable[[int, bytes], None] | None = None,
):
    """Read the server's stdout and stderr until both markers of `nonce`; keep at most `cap` bytes
    of each. Stops early (then calls `kill`) at `deadline` ("timeout"), when `over_workspace()`
    ("workspace", polled every CHECK_EVERY_S) or when a pipe closes ("died"). Returns
    ((stdout, its length), (stderr, its length), exit code or None, why it stopped early or None)."""
    out_fd = proc.stdout.fileno()
    fds = {out_fd: b"\036" + nonce.encode() + b":", proc.stderr.fileno(): b"\036" + nonce.encode() + b"\n"}
    kept = {fd: bytearray() for fd in fds}  # first `cap` bytes
    tail = {fd: bytearray() for fd in fds}  # last bytes, to find the marker in discarded output
    total = {fd: 0 for fd in fds}
    done: dict[int, int] = {}  # fd -> output length before its marker
    sent = {fd: 0 for fd in fds}  # bytes of kept already passed to on_output
    rc, why, next_check = None, None, time.perf_counter() + CHECK_EVERY_S
    while len(done) < 2:
        now = time.perf_counter()
        if now >= deadline:
            why = "timeout"
            break
        if now >= next_check:
            next_check = now + CHECK_EVERY_S
            if over_workspace():
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
            tail[fd] = (tail[fd] + chunk)[-(len(fds[fd]) + 32) :]
            if fds[fd] in tail[fd] and (fd != out_fd or tail[fd].endswith(b"\n")):
                i = tail[fd].rfind(fds[fd])
                done[fd] = total[fd] - (len(tail[fd]) - i)
                if fd == out_fd:
                    rc = int(tail[fd][i + len(fds[fd]) :].strip())
            if on_output is not None:
                # hold back only a tail that could still turn out to be the start of the marker
                hold = next(
                    (k for k in range(min(len(fds[fd]), len(tail[fd])), 0, -1) if tail[fd].endswith(fds[fd][:k])), 0
                )
                upto = min(done.get(fd, total[fd] - hold), len(kept[fd]), cap)
                if upto > sent[fd]:
                    on_output(1 if fd == out_fd else 2, bytes(kept[fd][sent[fd] : upto]))
                    sent[fd] = upto
        if why:
            break
    if why == "died":  # bwrap or the server exited: keep what it said (bwrap's errors go to stderr)
        err_fd = proc.stderr.fileno()
        while len(kept[err_fd]) < cap and (chunk := os.read(err_fd, 1 << 16)):
            kept[err_fd] += chunk
            total[err_fd] += len(chunk)
    if why is not None:
        kill()
    if on_output is not None:
        for fd in fds:
            upto = min(done.get(fd, total[fd]), len(kept[fd]), cap)
            if upto > sent[fd]:
                on_output(1 if fd == out_fd else 2, bytes(kept[fd][sent[fd] : upto]))
    res = []
    for fd in fds:
        n = done.get(fd, total[fd])
        res.append((bytes(kept[fd][: min(n, cap)]), n))
    return res[0], res[1], rc, why
