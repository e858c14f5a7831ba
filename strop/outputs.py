"""Writing outputs safely: what a command may delete, and files written whole or not at all.

A command deletes only a run directory it made (`remove_run_dir`), never a path it was handed
that merely resolves somewhere: not `out_dir` itself, not a parent of it or of the working
directory, not something reached through a symbolic link, not a folder strop did not create.
A file a later step trusts (a weight delta, a decoded snapshot, a cache, a result) is written to a
temporary file beside it and renamed into place (`write_atomic`), so a kill mid-write leaves the
previous file, never a truncated one; a directory of them (a model, a checkpoint) likewise
(`atomic_dir`).
"""

import glob
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from strop.errors import UserError

RUN_MARKER = "summary.json"  # `strop demo` writes it into every run directory it makes, first thing


def remove_run_dir(run_dir: Path, out_dir: Path) -> None:
    """Delete `run_dir` (= out_dir/name) for a fresh run, or raise UserError saying why not."""
    if run_dir.is_symlink():
        raise UserError(f"not deleting {str(run_dir)!r}: it is a symbolic link")
    if not run_dir.exists():
        return
    resolved, parent = run_dir.resolve(), out_dir.resolve()
    if resolved.parent != parent:
        raise UserError(f"not deleting {str(run_dir)!r}: it resolves to {str(resolved)!r}, outside {str(parent)!r}")
    cwd = Path.cwd().resolve()
    if cwd == resolved or resolved in cwd.parents:
        raise UserError(f"not deleting {str(run_dir)!r}: it holds the working directory")
    if not resolved.is_dir() or not (resolved / RUN_MARKER).is_file():
        raise UserError(
            f"not deleting {str(run_dir)!r}: it is not a strop run directory (no {RUN_MARKER}); "
            "delete it yourself or choose another run.name"
        )
    shutil.rmtree(resolved)


OUTPUT_MARKER = ".strop-output"  # in a directory a command made and may therefore overwrite and clear


def claim_dir(path: Path, command: str) -> Path:
    """`path` as the output directory of `command`, which will overwrite and delete things inside it:
    it must be new, empty, or made by `command` before (it holds OUTPUT_MARKER naming it), never a
    folder of the user's (`strop train --out runs/sft/model` would overwrite that model's config.json)."""
    path = Path(path)
    marker = path / OUTPUT_MARKER
    if path.exists() and not path.is_dir():
        raise UserError(f"output directory {str(path)!r} is a file")
    if path.is_dir() and any(path.iterdir()) and not (marker.is_file() and marker.read_text().strip() == command):
        raise UserError(
            f"output directory {str(path)!r} is not empty and was not made by `strop {command}`; "
            "choose a new or empty one"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create output directory {str(path)!r}: {e.strerror}") from None
    marker.write_text(command + "\n")
    return path


def check_output_file(path: str | os.PathLike, make_parents: bool = False) -> Path:
    """The path a command will write a file to, refused up front (before any work) when it cannot be:
    a directory, or a file in a directory that does not exist (created instead with `make_parents`)."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"output {str(p)!r} is a directory; give a file name")
    if make_parents:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"output {str(p)!r}: cannot create its directory: {e.strerror}") from None
    if not p.parent.is_dir():
        raise UserError(f"output {str(p)!r}: directory {str(p.parent)!r} does not exist")
    return p


def write_atomic(path: str | os.PathLike, data: bytes | memoryview | str) -> None:
    """Write `data` (str as UTF-8) to `path` through a temporary file in the same directory,
    flushed to disk and renamed over `path` (a rename within one file system is atomic)."""
    p = Path(path)
    if isinstance(data, str):
        data = data.encode()
    for stale in p.parent.glob(f".{glob.escape(p.name)}.*.tmp"):  # left by a writer killed before its rename
        pid = stale.name[len(p.name) + 2 : -4]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            stale.unlink(missing_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Yield an empty temporary directory beside `path`; once the block has filled it, it replaces
    `path`. The previous directory is renamed to `<path>.old` first and removed last, so a kill at
    any moment leaves a whole directory at `path` or at `<path>.old`, never a half-written one."""
    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    shutil.rmtree(old, ignore_errors=True)  # a previous run killed before it removed its .old
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
