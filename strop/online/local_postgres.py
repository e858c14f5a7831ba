"""A throwaway PostgreSQL server on this machine, for the tests and `strop bench feedback`: a real
server (initdb, postgres), never a stand-in. The binaries come from the `pgserver` package (which
ships them; the `dev` extra installs it) or from the system's PostgreSQL (`pg_ctl` on PATH or
under /usr/lib/postgresql). PostgreSQL refuses to run as root, so as root the server runs as the
unprivileged `nobody`. It listens only on a Unix socket in its own temporary directory.
"""

import contextlib
import glob
import importlib.util
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator


class NoPostgres(RuntimeError):
    """No PostgreSQL server binaries here (the message says where they were looked for)."""


def find_binaries() -> Path:
    """The directory holding `initdb` and `pg_ctl`, or NoPostgres."""
    candidates = []
    spec = importlib.util.find_spec("pgserver")  # located, not imported: importing it starts nothing we need
    if spec is not None and spec.submodule_search_locations:
        candidates.append(Path(spec.submodule_search_locations[0]) / "pginstall" / "bin")
    if shutil.which("pg_ctl"):
        candidates.append(Path(shutil.which("pg_ctl")).resolve().parent)
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    for c in candidates:
        if (c / "initdb").exists() and (c / "pg_ctl").exists():
            return c
    raise NoPostgres("no PostgreSQL server binaries: pip install pgserver (the dev extra), or the system's postgresql")


def _as_user() -> tuple[dict, int | None]:
    """Popen arguments that drop root to `nobody` (PostgreSQL will not run as root), and its uid."""
    if os.geteuid() != 0:
        return {}, None
    nobody = pwd.getpwnam("nobody")
    return {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}, nobody.pw_uid


def _world_reachable(path: Path) -> bool:
    """Whether any user can traverse every folder down to `path` (others' execute bit on each)."""
    return all(p.stat().st_mode & 0o001 for p in [path, *path.parents])


def _copy_install(bin_dir: Path, dest: Path) -> Path:
    """The installation around `bin_dir` copied under `dest`, where the unprivileged user can read
    it; the new bin dir. PostgreSQL finds lib and share relative to its binaries, and pgserver's
    binaries their libraries at $ORIGIN/../../../pgserver.libs, so the copy keeps that layout."""
    install = bin_dir.parent  # .../site-packages/pgserver/pginstall
    package, site = install.parent, install.parent.parent
    to = dest / package.name / install.name
    for part in ("bin", "lib", "share"):
        if (install / part).is_dir():
            shutil.copytree(install / part, to / part, symlinks=True)
    if (site / f"{package.name}.libs").is_dir():
        shutil.copytree(site / f"{package.name}.libs", dest / f"{package.name}.libs", symlinks=True)
    for d in [dest, *dest.rglob("*")]:
        if d.is_dir():
            d.chmod(0o755)
    return to / "bin"


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Start a fresh server, yield its URL (database `postgres`), stop it and delete its files."""
    bin_dir = find_binaries()
    drop, uid = _as_user()
    root = Path(tempfile.mkdtemp(prefix="strop-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if uid is not None:
        root.chmod(0o755)
        os.chown(sock, uid, -1)
        os.chown(root, uid, -1)
        if not _world_reachable(bin_dir):  # e.g. a clone in a 0700 folder: nobody cannot reach the binaries
            bin_dir = _copy_install(bin_dir, root / "pg")
    user = pwd.getpwuid(uid if uid is not None else os.geteuid()).pw_name
    env = {**os.environ, "LC_ALL": "C"}

    def run(*cmd: str) -> None:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, **drop)
        if out.returncode != 0:
            raise NoPostgres(f"{Path(cmd[0]).name} failed: {(out.stderr or out.stdout).strip()[-500:]}")

    try:
        run(
            str(bin_dir / "initdb"), "-D", str(data), "-U", user, "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"
        )
        run(
            str(bin_dir / "pg_ctl"),
            "-D",
            str(data),
            "-l",
            str(root / "log"),
            "-w",
            "-t",
            "60",
            "start",
            "-o",
            f"-c listen_addresses='' -c unix_socket_directories={sock} -c max_connections=200",
        )
        try:
            yield f"postgresql://{user}@/postgres?host={sock}"
        finally:
            subprocess.run(
                [str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                capture_output=True,
                env=env,
                cwd=root,
                **drop,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
