"""Build a C source string with the system compiler and load it through ctypes.

Used for the few hot loops that numpy or torch cannot express cheaply (the engine's CPU
kernels, the weight-sync delta coder). The shared object is built with -O3 -march=native and
cached under ~/.cache/strop (or $XDG_CACHE_HOME/strop) keyed by a hash of the source and this
CPU's flags, so a cached copy built for another machine is never loaded. Without a C compiler,
when the build fails, or with STROP_NO_KERNELS set, `load_library` returns None and callers
take their pure-Python path.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def _key(source: str) -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha256((source + flags).encode()).hexdigest()[:16]


def load_library(name: str, source: str) -> ctypes.CDLL | None:
    """The compiled `source` (built on first use, then loaded from the cache), or None when it
    cannot be had here; `name` prefixes the cached file's name."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or os.environ.get("STROP_NO_KERNELS"):
        return None
    try:
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "strop"
        so = cache / f"{name}_{_key(source)}.so"
        if not so.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory() as d:
                src, tmp = Path(d) / f"{name}.c", Path(d) / f"{name}.so"
                src.write_text(source)
                r = subprocess.run([cc, "-O3", "-march=native", "-shared", "-fPIC", str(src), "-o", str(tmp), "-lm"],
                                   capture_output=True, timeout=120)
                if r.returncode != 0:
                    return None
                os.replace(tmp, so)  # atomic: concurrent builders never load a half-written file
        return ctypes.CDLL(str(so))
    except (OSError, subprocess.SubprocessError):
        return None
