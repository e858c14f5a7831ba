"""The mount layout of a bubblewrap sandbox: what its root holds, who its user is, and the bwrap
arguments that build it (`static_argv`), plus the per-image files those mounts need (`prepare_root`:
an /etc without host secrets, with the sandbox user and hostname, and a ~/.profile).

The root is an allowlist: an empty read-only tmpfs with SYSTEM_DIRS bound read-only from the
image and EMPTY_DIRS as empty directories, so nothing host-private (/root, /work, /opt,
infrastructure files at the top level) is visible by default; on the host's root, strop's own
directories (the node cache with its git mirrors and other commits' checkouts, the scratch and
temporary roots of other tasks' worlds) are covered by an empty tmpfs where a bound directory would
show them (/var/cache/strop, the default as root, is under /var). It is also fast: each mount costs
setup time, and this layout needs about a dozen.
"""

import functools
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from strop.confined import apply_changes, copy_tree, lstat_beneath, open_in_root, write_new
from strop.env.host.node_cache import node_cache
from strop.env.host.scratch import scratch_base
from strop.env.sandbox import python as sandbox_python
from strop.env.sandbox.interface import Limits
from strop.errors import UserError

HOSTNAME = "devbox"
USER, UID, GID = "dev", 1000, 1000
HOME = "/home/dev"
# the root is an allowlist: these top-level entries come read-only from the image...
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "var")
# ...these are empty directories; everything else (/work, /opt, infrastructure files) is absent
EMPTY_DIRS = ("boot", "media", "mnt", "opt", "root", "run", "srv", "sys")  # the host sysfs shows host devices
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# files of the image's /etc the sandbox does not get (host secrets)
_ETC_FILE_BYTES = 1 << 20  # the most of an image's /etc/passwd or /etc/group read
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
    host secrets (one bind mount instead of one per file), and ~/.profile. The image is untrusted:
    its links are copied as links and never followed (strop's own files replace them), its
    /etc/passwd and /etc/group are read as the sandbox will see them (a link resolves inside the
    image), and what it lacks of them is made afresh. UserError when the image has no usable /etc."""
    etc = root / "etc"
    image_etc = Path(image) / "etc"
    if os.path.islink(image_etc) or not os.path.isdir(image_etc):  # copying it would follow the link on the host
        raise UserError(f"image {image}: /etc is not a directory")
    copy_tree(image_etc, etc, ignore=_ETC_SECRETS)
    passwd = [l for l in _image_text(image, "etc/passwd").splitlines() if l.split(":")[2:3] != [str(UID)]]
    group = [l for l in _image_text(image, "etc/group").splitlines() if l.split(":")[2:3] != [str(GID)]]
    hosts = f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    try:
        apply_changes(  # beneath the copy: a link there is replaced, never written through
            etc,
            {
                "passwd": "\n".join(passwd + [f"{USER}:x:{UID}:{GID}:{USER}:{HOME}:/bin/bash"]) + "\n",
                "group": "\n".join(group + [f"{USER}:x:{GID}:"]) + "\n",
                "hostname": HOSTNAME + "\n",
                "hosts": hosts,
            },
        )
    except UserError as e:
        raise UserError(f"image {image}: its /etc cannot take the sandbox's own files ({e})") from None
    # the host's root gets strop's interpreter (sandbox_python) first on PATH; an OS image has its own
    path = f"{sys.prefix}/bin:{SYSTEM_PATH}" if image == "/" else SYSTEM_PATH
    write_new(root / "profile", f'# ~/.profile\nPATH="{path}"\n[ -f "$HOME/.bashrc" ] && . "$HOME/.bashrc"\n'.encode())
    return ImageRoot(image, root, etc, root / "profile", path)


def _hide_from_host_root(*paths: Path) -> list[str]:
    """bwrap arguments covering each of `paths` with an empty read-only tmpfs where a directory the
    host's root binds (SYSTEM_DIRS: /var holds /var/cache/strop) would show it; none where it shows
    nothing (/tmp, /home and /dev are the sandbox's own)."""
    covered: list[str] = []
    for path in sorted(os.path.realpath(p) for p in paths):
        for name in SYSTEM_DIRS:
            bound = os.path.realpath(f"/{name}")
            if not os.path.islink(f"/{name}") and path.startswith(bound.rstrip("/") + "/"):
                inside = f"/{name}/{os.path.relpath(path, bound)}"
                if not any(inside.startswith(c + "/") or inside == c for c in covered):
                    covered.append(inside)
    return [a for c in covered for a in ("--size", "4096", "--perms", "0755", "--tmpfs", c, "--remount-ro", c)]


def _image_text(image: str, path: str) -> str:
    """The text of the image's file `path` as a process in the image reads it (a link resolves inside
    the image), at most 1 MB; "" when it has none or it is not a regular file."""
    root_fd = os.open(image, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = open_in_root(root_fd, path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return ""
    finally:
        os.close(root_fd)
    try:
        data = os.read(fd, _ETC_FILE_BYTES) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    finally:
        os.close(fd)
    return data.decode(errors="replace")


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
    if image == "/":  # the node cache's mirrors hold the fixes; scratch and temp roots, other tasks' worlds
        a += _hide_from_host_root(node_cache(), scratch_base(), shared.root.parent)
    a += ["--ro-bind", str(shared.etc), "/etc"]
    for name in EMPTY_DIRS:
        a += ["--perms", "0700" if name == "root" else "0755", "--dir", f"/{name}"]
    var_tmp = lstat_beneath(Path(image), "var/tmp")  # a link there is the image's, not a place to mount on
    if var_tmp is not None and stat.S_ISDIR(var_tmp.st_mode):
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
