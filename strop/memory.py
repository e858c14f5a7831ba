"""Keep freed heap memory in the process, so repeated short-lived buffers cost no page faults.

glibc hands freed memory above M_TRIM_THRESHOLD back to the kernel and serves allocations
above M_MMAP_THRESHOLD (at most 32 MB) with fresh mappings. Both adapt, but one codec call allocates and frees
several multi-MB temporaries, so every call lands on fresh pages again. A page fault costs
~0.2 µs on bare metal and ~2.5 µs in a VM like the benchmark machine's, where faults were half
of the codec's CPU time. A long-lived publisher or engine, whose allocation sizes repeat, loses
nothing by keeping some freed memory: every `strop` command calls this at start (training steps
sped up ~20% here), and so do the inline RL runtime and its trainer process when used as a library.
"""

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # mallopt parameters (glibc malloc.h)
TRIM = 1 << 30  # freed memory kept before any is handed back


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where malloc is not glibc's."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError):
        return False
    # no mmap at all: the mmap threshold tops out at 32 MB, and a 50M-element tensor's temporaries
    # are larger, so they would still land on fresh pages every call
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM))
