"""Set torch/BLAS thread counts deliberately: every process strop starts calls `set_threads` first."""

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def set_threads(n: int | None = None) -> int:
    """Pin intra-op threads to `n` (default: STROP_THREADS or all cores) and inter-op threads to 1.

    Env vars are set too, so child processes and libraries loaded later agree. Torch is configured
    only if this process already imported it: a process that never needs torch (a sandbox command,
    a benchmark of the world) should not pay seconds to import it, and a later import reads
    OMP_NUM_THREADS.
    """
    if n is None:
        n = int(os.environ.get("STROP_THREADS", os.cpu_count() or 1))
    n = max(1, n)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    os.environ["STROP_THREADS"] = str(n)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass  # torch allows this only before its first parallel work; the default then stands
    kernels = sys.modules.get("strop.kernels")
    if kernels is not None:  # loaded already: its products split between n threads from now on
        kernels.set_threads(n)
    return n


def wait_passively() -> None:
    """Make OpenMP threads sleep at a barrier instead of spinning (OMP_WAIT_POLICY=PASSIVE, unless
    set), for this process and its children; it must be set before torch loads. On 2 cores shared
    with other work a spinning thread holds a core its descheduled partner needs: a demo mid-training
    step took 4.6-6.8 s with 2 spinning threads beside other jobs, 1.1-1.3 s with 2 passive ones
    (0.8-1.0 s with one thread), and the numbers are the same bits."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


GIL_SWITCH_S = 0.0005


def hand_over_gil_quickly() -> None:
    """Make a thread that holds the GIL running Python hand it over after 0.5 ms instead of
    Python's 5 ms. An engine's loop thread releases the GIL for every kernel and torch call and
    must win it back each time; beside rollout threads that run Python (sandbox I/O, tokenizing,
    the checker), each win waited up to 5 ms, and an engine decoded at 81 tokens/s beside 8 such
    threads where it decodes 622 alone; at 0.5 ms, 642."""
    sys.setswitchinterval(GIL_SWITCH_S)


@contextmanager
def child_environment(**overrides: str) -> Iterator[None]:
    """`os.environ` with `overrides` while a child process starts (it copies the environment then),
    as it was afterwards. For settings a library reads once, at load: OpenMP's wait policy must be
    in the environment before the child imports torch."""
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
