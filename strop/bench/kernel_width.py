"""`strop bench kernel-width [--json F]`: the matrix kernel built for this CPU (16-float vectors
where it has AVX-512) against the same source built for x86-64-v3 (8-float AVX2 vectors), on the
product shapes of the demo's model and of SmolLM2-135M, at batch 1 and 16: microseconds per call,
the ratio, and whether both builds give the same bits (they must: `strop.cpu` relies on it to leave
the kernels unpinned). On a CPU without AVX-512 both builds are 8-float and the ratio is ~1.
"""

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

# (rows, out features, in features): the demo's MoE expert and head, SmolLM2-135M's MLP and head
SHAPES = ((16, 4096, 128), (1, 1536, 576), (16, 1536, 576), (16, 576, 1536), (16, 49152, 576))
BUILDS = {"this CPU": ("-march=native",), "x86-64-v3": ("-march=x86-64-v3",)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", help="write results to this JSON file")


def _build(directory: Path, extra: tuple[str, ...], name: str) -> ctypes.CDLL:
    from strop import kernels
    from strop.native import FLAGS, read_sources

    src, so = directory / "kernels.c", directory / f"{name}.so"
    src.write_text(read_sources("strop.kernels", *kernels.SOURCES))
    subprocess.run(["cc", *FLAGS, *extra, str(src), "-o", str(so), "-lm"], check=True)
    return ctypes.CDLL(str(so))


def _time(call, reps: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            call()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def run(args: argparse.Namespace) -> int:
    import torch

    from strop import kernels
    from strop.bench.table import format_table, write_json
    from strop.cpu import describe, describe_line

    P, I64 = ctypes.c_void_p, ctypes.c_int64
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        libs = {name: _build(Path(d), extra, f"k{i}") for i, (name, extra) in enumerate(BUILDS.items())}
        for n_rows, n, m in SHAPES:
            for bf16 in (False, True):
                w = torch.randn(n, m)
                packed = kernels.pack_linear(w.bfloat16().float() if bf16 else w, as_bf16=bf16)
                x, outs, us = torch.randn(n_rows, m), [], {}
                for name, lib in libs.items():
                    y = torch.empty(n_rows, n)
                    call_args = (P(x.data_ptr()), I64(n_rows), P(packed.data.data_ptr()), I64(int(bf16)), None)
                    call_args += (P(y.data_ptr()), I64(m), I64(n))
                    us[name] = _time(lambda: lib.linear_packed(*call_args), max(3, int(2e8 / (n_rows * n * m)))) * 1e6
                    outs.append(y)
                here, v3 = us.values()
                rows.append(
                    {
                        "rows": n_rows,
                        "out": n,
                        "in": m,
                        "weights": "bf16" if bf16 else "fp32",
                        "us_this_cpu": here,
                        "us_x86_64_v3": v3,
                        "v3_over_this": v3 / here,
                        "same_bits": torch.equal(outs[0], outs[1]),
                    }
                )
    cpu = describe()
    print(f"the matrix kernel built for this CPU vs for x86-64-v3; cpu: {describe_line(cpu)}")
    print(format_table(rows, list(rows[0])))
    write_json(args.json, {"rows": rows, "cpu": cpu})
    return 0
