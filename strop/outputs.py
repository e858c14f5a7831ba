"""Writing outputs safely: what a command may delete or overwrite, and files written whole or not at all.

One rule for deleting and overwriting: a command deletes or overwrites only a directory a strop
command made, recognised by the marker file (`OUTPUT_MARKER`, naming the command) it wrote there
when it made it, and reached without following a symbolic link at its last component or below.
`claim_dir` takes a directory as a command's output (new, empty, or its own: never a folder the
user made or filled); `remove_output` deletes one (`demo --fresh`, `train --force`, the benchmarks'
runs); `claiming` removes again what a command made when it is refused before its work begins.
A run directory records the config it was made with (`record_config`), so a rerun under another
config is refused with what changed instead of reporting or resuming the old run as if it were new.

A file a later step trusts (a weight delta, a decoded snapshot, a cache, a result) is written to a
temporary file beside it and renamed into place (`write_atomic`), so a kill mid-write leaves the
previous file, never a truncated one; a directory of them (a model, a checkpoint) likewise
(`atomic_dir`).
"""

import glob
import json
import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from strop.config import dotted
from strop.confined import read_regular
from strop.errors import UserError
from strop.lifetime import process_gone

OUTPUT_MARKER = ".strop-output"  # in a directory a command made and may therefore overwrite and delete
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _made_by(dir_fd: int) -> str | None:
    """The command named by the marker in the directory open as `dir_fd`; None without a marker
    that is a small regular file (a link named like the marker is no marker)."""
    data = read_regular(OUTPUT_MARKER, dir_fd, max_bytes=256)
    return None if data is None else data.decode(errors="replace").strip()


def made_by(path: Path) -> str | None:
    """The command that made the directory `path` (itself not a symbolic link), or None."""
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError:
        return None
    try:
        return _made_by(fd)
    finally:
        os.close(fd)


def claim_dir(path: Path, command: str) -> Path:
    """`path` as the output directory of `command`, which will overwrite and delete things inside it:
    it must be new, empty, or made by `command` before (it holds OUTPUT_MARKER naming it), never a
    folder of the user's (`strop train --out runs/sft/model` would overwrite that model's config.json)
    nor a symbolic link. Made (with its parents) and marked here."""
    path = Path(path)
    if path.is_symlink():
        raise UserError(f"output directory {str(path)!r} is a symbolic link; name the directory itself")
    if path.exists() and not path.is_dir():
        raise UserError(f"output directory {str(path)!r} is not a directory")
    if path.is_dir() and any(path.iterdir()) and made_by(path) != command:
        raise UserError(
            f"output directory {str(path)!r} is not empty and was not made by `strop {command}`; "
            "choose a new or empty one"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create output directory {str(path)!r}: {e.strerror}") from None
    if made_by(path) != command:
        (path / OUTPUT_MARKER).write_text(command + "\n")
    return path


def remove_output(path: Path, command: str) -> None:
    """Delete the directory `path` that `command` made, or raise UserError saying why not; nothing
    there, nothing to do. Never a symbolic link, a folder without the marker, one holding the working
    directory; the walk runs from the parent's descriptor and follows no link inside."""
    path = Path(path)
    if path.name in ("", ".", ".."):
        raise UserError(f"not deleting {str(path)!r}: it names no directory of its own")
    try:
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as e:
        raise UserError(f"not deleting {str(path)!r}: {e.strerror}") from None
    try:
        try:
            st = os.lstat(path.name, dir_fd=parent)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise UserError(f"not deleting {str(path)!r}: it is a symbolic link")
        if not stat.S_ISDIR(st.st_mode):
            raise UserError(f"not deleting {str(path)!r}: it is not a directory")
        fd = os.open(path.name, _DIR_FLAGS, dir_fd=parent)
        try:
            maker = _made_by(fd)
        finally:
            os.close(fd)
        if maker != command:
            raise UserError(
                f"not deleting {str(path)!r}: it was not made by `strop {command}` (no {OUTPUT_MARKER} naming it); "
                "delete it yourself or choose another"
            )
        here = Path(os.path.realpath(path.parent)) / path.name
        cwd = Path.cwd().resolve()
        if cwd == here or here in cwd.parents:
            raise UserError(f"not deleting {str(path)!r}: it holds the working directory")
        shutil.rmtree(path.name, dir_fd=parent)
    finally:
        os.close(parent)


@contextmanager
def claiming(path: Path, command: str) -> Iterator[Path]:
    """`claim_dir(path, command)` for the block that sets a command's work up: when the block
    raises (a refusal, a failed start), the directory is removed again if the claim made it, and so
    are the parents it made, so a refused command leaves nothing behind. A directory that was there
    before is left as it was."""
    path = Path(path)
    made = [p for p in [path, *path.parents] if not os.path.lexists(p)]
    claim_dir(path, command)
    try:
        yield path
    except BaseException:
        if made:
            remove_output(path, command)
            for p in made[1:]:
                try:
                    p.rmdir()  # empty, made here
                except OSError:
                    break
        raise


CONFIG_RECORD = "config.json"  # the resolved config a run directory was made with


def config_changes(old: dict, new: dict, ignore: tuple[str, ...] = ()) -> dict[str, tuple]:
    """key -> (old, new) for the keys both configs hold with different values, `ignore`d keys (and
    keys under an ignored section) aside. A key only one side has is a schema difference between
    strop versions, not a change of the user's."""
    a, b = dotted(old), dotted(new)
    skip = lambda k: any(k == i or k.startswith(i + ".") for i in ignore)  # noqa: E731
    return {k: (a[k], b[k]) for k in sorted(a.keys() & b.keys()) if a[k] != b[k] and not skip(k)}


def describe_changes(changes: dict[str, tuple]) -> str:
    """`rl.steps 10 -> 20, rl.lr 0.0001 -> 2e-05` (the first few and how many more)."""
    parts = [f"{k} {json.dumps(a)} -> {json.dumps(b)}" for k, (a, b) in list(changes.items())[:6]]
    more = f" and {len(changes) - 6} more" if len(changes) > 6 else ""
    return ", ".join(parts) + more


def recorded_config(run_dir: Path) -> dict | None:
    """The config `run_dir` records, or None when it records none (a new run); UserError when the
    record is damaged."""
    p = Path(run_dir) / CONFIG_RECORD
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{str(p)!r} is damaged ({type(e).__name__}); its run cannot be checked") from None


def record_config(run_dir: Path, config: dict) -> None:
    write_atomic(Path(run_dir) / CONFIG_RECORD, json.dumps(config, indent=2))


def check_output_file(path: str | os.PathLike) -> Path:
    """The path a command will write a file to, refused up front (before any work) when it cannot be:
    a directory, or a file in a directory that does not exist (made by nobody but the user: a
    command writes the file it was named, not folders on the way to it)."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"output {str(p)!r} is a directory; give a file name")
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
        if process_gone(pid):
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
