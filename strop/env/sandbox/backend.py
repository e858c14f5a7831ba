"""Which sandbox backend opens a world. Bubblewrap is the one backend so far; a container, microVM
or remote-pool backend would implement `strop.env.sandbox.interface.Sandbox` and be chosen here."""

from pathlib import Path

from strop.env.sandbox.bwrap import BwrapSandbox
from strop.env.sandbox.interface import Limits, Sandbox


def open_sandbox(world: Path, limits: Limits = Limits(), image: str = "/") -> Sandbox:
    """Start a sandbox whose WORKDIR is a copy-on-write view of the directory `world`, on the
    read-only system root `image`."""
    return BwrapSandbox(Path(world), limits, image)
