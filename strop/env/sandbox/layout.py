"""The mount layout of a bubblewrap sandbox: what its root holds, who its user is, and the bwrap
arguments that build it (`static_argv`), plus the per-image files those mounts need (`prepare_root`:
an /etc without host secrets, with the sandbox user and hostname, and a ~/.profile).

The root is an allowlist: an empty read-only tmpfs with SYSTEM_DIRS bound read-only from the
image and EMPTY_DIRS as empty directories, so nothing host-private (/root, /work, /opt,
infrastructure files at the top level) is visible by default. It is also fast: each mount costs
setup time, and this layout needs about a dozen.
"""

import functools
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from strop.env.sandbox import python as sandbox_python
from strop.env.sandbox.interface import Limits

HOSTNAME = "devbox"
USER, UID, GID = "dev", 1000, 1000
HOME = "/home/dev"
# the root is an allowlist: these top-level entries come read-only from the image...
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "var")
# ...these are empty directories; everything else (/work, /opt, infrastructure files) is absent
EMPTY_DIRS = ("boot", "media", "mnt", "opt", "root", "run", "srv", "sys")  # the host sysfs shows host devices
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# files of the image's /etc the sandbox does not get (host secrets)
_ETC_SECRETS = ("shadow", "shadow-", "gshadow", "gshadow-", "sudoers", "sudoers.d", "ssh_host_*", "*.key", "machine-id")


@dataclass(frozen=True)
class ImageRoot:
    """What the sandboxes of one image share in this process: the temp root their copy-on-write
    layers live under, the /etc copy bound at /etc, the ~/.profile file, the sandbox's PATH."""

    image: str
    root: Path
    etc: Path
    profile: Path
    path: str


def prepare_root(image: str, root: Path) -> ImageRoot:
    """Fill `root` with a copy of the image's /etc with the `dev` user, the hostname and without
    host secrets (one bind mount instead of one per file), and ~/.profile."""
    etc = root / "etc"
    if os.path.islink(Path(image) / "etc"):  # copying it would follow the link on the host
        raise ValueError(f"image {image}: /etc is a symlink")
    shutil.copytree(
        Path(image) / "etc",
        etc,
        symlinks=True,
        ignore=shutil.ignore_patterns(*_ETC_SECRETS),
        copy_function=_copy_readable,
    )
    passwd = [l for l in (etc / "passwd").read_text().splitlines() if l.split(":")[2:3] != [str(UID)]]
    (etc / "passwd").write_text("\n".join(passwd + [f"{USER}:x:{UID}:{GID}:{USER}:{HOME}:/bin/bash"]) + "\n")
    group = [l for l in (etc / "group").read_text().splitlines() if l.split(":")[2:3] != [str(GID)]]
    (etc / "group").write_text("\n".join(group + [f"{USER}:x:{GID}:"]) + "\n")
    (etc / "hostname").write_text(HOSTNAME + "\n")
    (etc / "hosts").write_text(
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    )
    # the host's root gets strop's interpreter (sandbox_python) first on PATH; an OS image has its own
    path = f"{sys.prefix}/bin:{SYSTEM_PATH}" if image == "/" else SYSTEM_PATH
    (root / "profile").write_text(f'# ~/.profile\nPATH="{path}"\n[ -f "$HOME/.bashrc" ] && . "$HOME/.bashrc"\n')
    return ImageRoot(image, root, etc, root / "profile", path)


def _copy_readable(src: str, dst: str) -> None:
    try:
        shutil.copy2(src, dst)
    except PermissionError:
        pass  # unreadable to us: unreadable to the sandbox user as well


@functools.cache
def static_argv(shared: ImageRoot, limits: Limits) -> tuple[str, ...]:
    """Everything but the per-sandbox parts (profile, workspace overlay, info fd), computed once per
    (image, limits); see the module docstring."""
    image = shared.image
    size = str(limits.workspace_mb << 20)  # writable tmpfs are bounded too (they live in RAM)
    a: list[str] = []
    for name in SYSTEM_DIRS:
        host = os.path.join(image, name)
        if os.path.islink(host):
            a += ["--symlink", os.readlink(host), f"/{name}"]
        elif os.path.isdir(host):
            a += ["--ro-bind", host, f"/{name}"]
    a += ["--ro-bind", str(shared.etc), "/etc"]
    for name in EMPTY_DIRS:
        a += ["--perms", "0700" if name == "root" else "0755", "--dir", f"/{name}"]
    if os.path.isdir(os.path.join(image, "var", "tmp")):
        a += ["--perms", "1777", "--size", size, "--tmpfs", "/var/tmp"]
    a += [
        "--perms",
        "1777",
        "--size",
        size,
        "--tmpfs",
        "/tmp",
        "--size",
        size,
        "--tmpfs",
        "/home",
        "--perms",
        "0755",
        "--dir",
        HOME,
    ]
    # /dev is a fresh tmpfs the sandbox user owns: make it read-only, give /dev/shm a bounded tmpfs
    a += [
        "--dev",
        "/dev",
        "--remount-ro",
        "/dev",
        "--perms",
        "1777",
        "--size",
        size,
        "--tmpfs",
        "/dev/shm",
        "--proc",
        "/proc",
    ]
    if image == "/":
        a += sandbox_python.binds()
    a += ["--remount-ro", "/"]  # after every directory on the root tmpfs exists
    # --disable-userns: no nested user namespaces, which would hand the agent capabilities (over
    # its own namespaces only, but that is kernel attack surface a coding task never needs)
    a += [
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--hostname",
        HOSTNAME,
        "--uid",
        str(UID),
        "--gid",
        str(GID),
        "--cap-drop",
        "ALL",
        "--die-with-parent",
        "--clearenv",
    ]  # no --new-session: see strop.env.sandbox.ctty
    # no --as-pid-1: bwrap's own init is pid 1 and reaps every orphan at once. With the server as pid
    # 1 the leftovers `kill -9 -1` kills stay zombies until the server next waits, and after a fork
    # bomb they fill the pids limit so that the next command cannot fork. The cost is one more small
    # process per sandbox; its start time could not be told apart from this VM's drift
    env = {
        "PATH": shared.path,
        "HOME": HOME,
        "USER": USER,
        "LOGNAME": USER,
        "SHELL": "/bin/bash",
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        # Python trusts a cached .pyc whose source has the same size and mtime (1 s): an edit made
        # within a second of the last import, same length, ran the old code, so the same episode's
        # test output depended on the machine's speed
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    for k, v in env.items():
        a += ["--setenv", k, v]
    return tuple(a)
