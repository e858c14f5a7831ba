"""The CPU strop runs on, and the instruction set its numerics are pinned to.

The same training run computed different weights on an AVX-512 and an AVX2 machine: PyTorch's
vectorized ops (ATen) and MKL's GEMMs pick code by instruction set, and their reductions round
differently at 16 lanes than at 8; from a few last bits apart, SFT's warm starts ended 11.5% and
39.5% solve rates apart. So on every x86-64 CPU with AVX2 and FMA (x86-64-v3: every server CPU
since 2015) strop computes as an AVX2 machine does: `pin_numerics` sets ATen's CPU capability to
AVX2, MKL's conditional numerical reproducibility to its AVX2 branch in strict mode (the same
GEMM bits at any thread count) and oneDNN's ISA to AVX2, before torch loads. An AVX-512 machine
then trains bit for bit what an AVX2 machine does (same thread count), at the cost of its wider
vectors in torch's ops. strop's own C kernels need no pin: they add the same products in the same
order at 16 and at 8 floats a vector (`tests/test_kernels.py`), so they stay built for this CPU
(`strop.native`), and decoding with them on AVX-512 equals an x86-64-v3 build's bit for bit
(`tests/test_numerics.py`) while running 1.5-1.8x faster at batch 16 (`strop bench kernel-width`).

`STROP_NUMERICS=native` leaves every library to pick for itself (fastest, machine-dependent), as
does a CPU without AVX2 or FMA, or another architecture. A variable the user set is never
overridden. Not covered: MKL documents its AVX2 branch as reproducible across Intel CPUs; on AMD
CPUs strop has not been compared bit for bit.
"""

import os
import platform
from functools import cache

from strop.native import march

# what each library reads, at load, to compute as an AVX2 machine does
PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"}
SHOWN_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx_vnni", "amx_tile")


@cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return {}
    out = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        out[key.strip()] = value.strip()
    return out


def flags() -> set[str]:
    """The CPU's feature flags (x86: /proc/cpuinfo's `flags`)."""
    info = _cpuinfo()
    return set((info.get("flags") or info.get("Features") or "").split())


def pinnable() -> bool:
    """Whether this CPU can compute as an AVX2 machine does (x86-64 with AVX2 and FMA)."""
    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= flags()


def numerics() -> str:
    """ "avx2" when strop's numerics are pinned to AVX2 here, else "native"."""
    return "avx2" if os.environ.get("STROP_NUMERICS", "avx2") != "native" and pinnable() else "native"


def pin_numerics() -> str:
    """Pin the libraries' numerics to AVX2 where `numerics()` says so (call before torch loads:
    ATen and MKL read their variables once); returns `numerics()`. Child processes inherit it."""
    mode = numerics()
    if mode == "avx2":
        for var, value in PINNED.items():
            os.environ.setdefault(var, value)
    return mode


def model_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (the architecture where it gives none)."""
    info = _cpuinfo()
    return info.get("model name") or info.get("Model") or platform.processor() or platform.machine()


def describe() -> dict:
    """The CPU in a few fields, for a run's summary: model, cores, the relevant flags, and the
    instruction set the numerics are pinned to (with what the libraries were told)."""
    have = flags()
    return {
        "model": model_name(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "flags": [f for f in SHOWN_FLAGS if f in have],
        "numerics": numerics(),
        "kernels": march(),
        "pinned": {k: os.environ[k] for k in PINNED if k in os.environ},
    }


def describe_line(cpu: dict) -> str:
    """`describe()` in one line."""
    pinned = ", ".join(f"{k}={v}" for k, v in cpu["pinned"].items()) or "nothing pinned"
    flags = " ".join(cpu["flags"])
    numerics = f"numerics {cpu['numerics']} ({pinned}); kernels -march={cpu['kernels']}"
    return f"{cpu['model']}, {cpu['cores']} cores, flags {flags}; {numerics}"
