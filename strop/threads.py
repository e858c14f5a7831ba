"""Set torch/BLAS thread counts deliberately: every process strop starts calls `set_threads` first."""

import os


def set_threads(n: int | None = None) -> int:
    """Pin intra-op threads to `n` (default: STROP_THREADS or all cores) and inter-op threads to 1.

    Env vars are set too so that child processes and BLAS libraries loaded later agree.
    """
    if n is None:
        n = int(os.environ.get("STROP_THREADS", os.cpu_count() or 1))
    n = max(1, n)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    os.environ["STROP_THREADS"] = str(n)
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set once in this process; torch only allows it before first parallel work
    return n
