"""Sandbox parity: the fingerprint an agent could probe, inside a sandbox and on the host, side by
side, and what differs (`strop env parity` prints it: `strop.commands.env_parity`).

A model that can tell a training sandbox from production can learn to behave differently in
each; this audit shows what it could notice. Each probe is a shell command run under `bash -lc`
in WORKDIR inside a fresh sandbox and in the repository directory on the host, as the current user.
Differences that are the point of the sandbox (the user and hostname it presents, hidden host
paths, no network) are listed like any other: the reader decides.

Not covered: timing side channels (the exec server adds ~1 ms per command), kernel-level
fingerprints (`uname`, /proc/cpuinfo are the host's, as in a container), and anything an agent
learns from the task itself.
"""

import subprocess
from pathlib import Path

# name -> shell command. Multi-line outputs are compared whole and shown by their first lines.
PROBES: dict[str, str] = {
    "hostname": "hostname",
    "/etc/hostname": "cat /etc/hostname",
    "user": "id -un",
    "id": "id",
    "HOME": "echo $HOME",
    "SHELL": "echo $SHELL",
    "pwd owner": "stat -c '%U:%G %a' .",
    "/proc/1/comm": "cat /proc/1/comm",
    "/proc/1/cmdline": "tr '\\0' ' ' < /proc/1/cmdline; echo",
    "pid of this shell": "echo $$",
    "processes visible": "ps -e --no-headers | wc -l",
    "ps format": "ps -o user,pid,tty,comm | head -2 | awk '{print $1, $3, $4}'",
    "ls -l format": "ls -ld /usr /etc /tmp | awk '{print $1, $3, $4, $NF}'",
    "top-level dirs": "ls -A / | tr '\\n' ' '",
    "/.dockerenv": "test -e /.dockerenv && echo present || echo absent",
    "mount types": "awk '{print $3}' /proc/mounts | sort | uniq -c | tr -s ' ' | tr '\\n' ' '",
    "mount of cwd": "awk -v d=\"$PWD\" '$2==d {print $3}' /proc/mounts",
    "cgroup": "cat /proc/self/cgroup | head -3",
    "net interfaces": "ls /sys/class/net 2>/dev/null | tr '\\n' ' '; grep -c : /proc/net/dev",
    "env var names": "env | cut -d= -f1 | sort | tr '\\n' ' '",
    "PATH": "echo $PATH",
    "nproc": "nproc",
    "os.cpu_count": "python3 -c 'import os; print(os.cpu_count())'",
    "python": "command -v python; python --version 2>&1",
    "python3": "command -v python3; python3 --version 2>&1",
    "pytest": "python -m pytest --version 2>&1 | head -1",
    "bash": "bash --version | head -1",
    "git": "git --version 2>&1",
    "uname": "uname -srm",
    "os-release": "grep PRETTY_NAME /etc/os-release",
    "ulimit -u/-v/-t/-f": "echo $(ulimit -u) $(ulimit -v) $(ulimit -t) $(ulimit -f)",
    "umask": "umask",
    "tty": "tty",
    "timezone": "date +%Z",
    "locale LANG": "echo $LANG",
    "/tmp writable": "touch /tmp/.parity-probe && rm /tmp/.parity-probe && echo yes || echo no",
    "capabilities": "grep CapEff /proc/self/status",
    "network": "timeout 3 bash -c 'echo > /dev/tcp/1.1.1.1/53' 2>/dev/null && echo reachable || echo unreachable",
}

_SEP = "@@strop-parity@@"


def _script() -> str:
    # a newline before each separator: a probe's output need not end with one
    return "".join(f"echo; echo '{_SEP} {name}'; ( {cmd} ) 2>&1\n" for name, cmd in PROBES.items())


def _parse(out: str) -> dict[str, str]:
    res: dict[str, str] = {}
    name = None
    for line in out.splitlines():
        if line.startswith(_SEP + " "):
            name = line[len(_SEP) + 1 :]
            res[name] = ""
        elif name is not None:
            res[name] += line + "\n"  # the blank line before the next separator is stripped below
    return {k: v.strip() for k, v in res.items()}


def probe_sandbox(repo_dir: Path, image: str = "/") -> dict[str, str]:
    from strop.env.sandbox.backend import open_sandbox
    from strop.env.sandbox.interface import Limits

    with open_sandbox(repo_dir, Limits(output_bytes=1 << 20), image) as sb:
        return _parse(sb.exec(_script(), timeout=60).stdout)


def probe_host(repo_dir: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    out = subprocess.run(
        ["bash", "-lc", _script()], cwd=repo_dir, env=env, capture_output=True, text=True, timeout=60
    ).stdout
    return _parse(out)


def compare(inside: dict[str, str], host: dict[str, str]) -> list[dict]:
    rows = []
    for name in PROBES:
        a, b = inside.get(name, ""), host.get(name, "")
        rows.append({"probe": name, "sandbox": a, "host": b, "same": a == b})
    return rows
