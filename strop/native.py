"""Build C sources with the system compiler and load them through ctypes.

Used for the few hot loops that numpy or torch cannot express cheaply (the engine's CPU
kernels, the weight-sync delta coder). Their C lives in `.c` files shipped inside the package
(`read_sources` joins a package's files into one translation unit, with `#line` marks so that a
compiler message names the file and line it is about). The shared object is built with -O3
-march=native (or -march=$STROP_MARCH: `x86-64-v3` builds what an AVX2 machine would) and warnings
on (-Wall -Wextra), and cached under ~/.cache/strop (or $XDG_CACHE_HOME/strop) keyed by a hash of
the source, the target and this CPU's flags, so a cached copy built for another machine is never
loaded. Warnings are printed to stderr when a build emits them: once,
since the result is cached.

Without a C compiler, or when the build fails, `load_library` says so in one line on stderr naming
the slow path the caller takes instead, and returns None; with STROP_NO_KERNELS set it returns None
silently (the slow path was asked for).
"""

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

from strop.memo import content_key

WARNINGS = ("-Wall", "-Wextra")
FLAGS = ("-O3", *WARNINGS, "-shared", "-fPIC", "-pthread")  # -pthread: the kernels' worker threads


def march() -> str:
    """The CPU the C is built for: this one, or STROP_MARCH (a gcc -march value)."""
    return os.environ.get("STROP_MARCH") or "native"


def read_sources(package: str, *names: str) -> str:
    """The C files `names` of `package` (package data), in this order, as one translation unit."""
    root = resources.files(package)
    return "".join(f'#line 1 "{package.replace(".", "/")}/{n}"\n' + (root / n).read_text() for n in names)


def _key(source: str) -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return content_key(source, march(), flags)


def _first_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return next((line for line in lines if "error" in line), lines[0] if lines else "no message")


def load_library(name: str, source: str, *, slow_path: str) -> ctypes.CDLL | None:
    """The compiled `source` (built on first use, then loaded from the cache), or None when it
    cannot be had here; `name` prefixes the cached file's name, and `slow_path` (what the caller
    runs instead) is named in the one line that says a build could not be had."""
    if os.environ.get("STROP_NO_KERNELS"):
        return None
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print(f"strop: no C compiler (cc or gcc) to build {name}; using {slow_path}", file=sys.stderr, flush=True)
        return None
    try:
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "strop"
        so = cache / f"{name}_{_key(source)}.so"
        if not so.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory() as d:
                src, tmp = Path(d) / f"{name}.c", Path(d) / f"{name}.so"
                src.write_text(source)
                r = subprocess.run(
                    [cc, *FLAGS, f"-march={march()}", str(src), "-o", str(tmp), "-lm"],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                if r.returncode != 0:
                    print(
                        f"strop: building {name} failed ({_first_error(r.stderr)}); using {slow_path}",
                        file=sys.stderr,
                        flush=True,
                    )
                    return None
                if r.stderr.strip():
                    print(
                        f"strop: {name} built with compiler warnings:\n{r.stderr.rstrip()}", file=sys.stderr, flush=True
                    )
                os.replace(tmp, so)  # atomic: concurrent builders never load a half-written file
        return ctypes.CDLL(str(so))
    except (OSError, subprocess.SubprocessError) as e:
        print(f"strop: building {name} failed ({e}); using {slow_path}", file=sys.stderr, flush=True)
        return None
