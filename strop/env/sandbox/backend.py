"""Which sandbox backend opens a sandbox. Bubblewrap is the one backend so far; a container, microVM
or remote-pool backend would implement `strop.env.sandbox.interface.Sandbox` and be chosen here."""

from pathlib import Path

from strop.env.sandbox.bwrap import BwrapSandbox
from strop.env.sandbox.interface import Limits, Sandbox


def open_sandbox(repo_dir: Path, limits: Limits = Limits(), image: str = "/") -> Sandbox:
    """Start a sandbox whose WORKDIR is a copy-on-write view of the directory `repo_dir`, on the
    read-only system root `image`."""
    return BwrapSandbox(Path(repo_dir), limits, image)
