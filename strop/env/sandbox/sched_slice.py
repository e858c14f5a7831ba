"""A short scheduler slice for the sandbox spawner's thread (and so every process it starts),
through the sched_getattr / sched_setattr syscalls, which Python's os module does not wrap.

Why: a sandbox start is a chain of a dozen hand-offs between short-lived processes (bwrap, its
init, the server, the command; each waits for the previous). On a busy machine each woken
process waited for a long-running task's slice to end (1.4 ms on this 2-CPU VM), which doubled
start+exit (p50 ~19 ms with a trainer on both CPUs). A woken task with a shorter slice
preempts at once (EEVDF, Linux 6.12+; older kernels ignore the request). CPU shares do not
change, only how finely a sandbox's processes interleave with others; the processes inside
the sandbox inherit it, and could have asked for it themselves. Nice and policy are kept.
"""

import ctypes
import os
import warnings

# the slice requested: below the default (0.7-3 ms by kernel and CPU count)
SLICE_NS = 300_000
_SCHED_SETATTR_GETATTR = {"x86_64": (314, 315), "aarch64": (274, 275)}  # syscall numbers


class _SchedAttr(ctypes.Structure):  # struct sched_attr, first version (48 bytes)
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("policy", ctypes.c_uint32),
        ("flags", ctypes.c_uint64),
        ("nice", ctypes.c_int32),
        ("priority", ctypes.c_uint32),
        ("runtime", ctypes.c_uint64),
        ("deadline", ctypes.c_uint64),
        ("period", ctypes.c_uint64),
    ]


def request_short_slice() -> None:
    """Give the calling thread, and so every process it starts, a slice of SLICE_NS; leaves the
    default on an architecture or kernel without sched_getattr, and for real-time policies."""
    nrs = _SCHED_SETATTR_GETATTR.get(os.uname().machine)
    libc = ctypes.CDLL(None, use_errno=True)
    attr = _SchedAttr()
    if nrs is None or libc.syscall(nrs[1], 0, ctypes.byref(attr), ctypes.sizeof(attr), 0) != 0:
        return  # an architecture or kernel without sched_getattr: leave the default
    if attr.policy not in (os.SCHED_OTHER, os.SCHED_BATCH):
        return  # real-time or deadline: slices do not apply
    attr.size, attr.flags, attr.runtime = ctypes.sizeof(attr), attr.flags & 1, SLICE_NS  # 1: RESET_ON_FORK
    if libc.syscall(nrs[0], 0, ctypes.byref(attr), 0) != 0:
        warnings.warn(
            f"sched_setattr failed ({os.strerror(ctypes.get_errno())}): sandboxes start slower on a busy machine",
            stacklevel=2,
        )
