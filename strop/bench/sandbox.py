"""`strop bench sandbox`: what a sandbox costs on this machine.

- the steps of a task sandbox's open and close (`strop.bench.sandbox_steps`: the world, the layer
  directories, bwrap's start, the first command, the kill, the removals), with a fresh copy of the
  task's repository per sandbox and with the copy its sandboxes share, alternately in one run, in
  an idle process and with `--busy-threads` Python threads spinning beside (the RL loop's engines
  and rollout workers are threads of one process);
- start+exit: `open_sandbox` + the first command (`true`) + `close`, cold (a new bwrap each time):
  wall-clock percentiles, the fastest run, and the CPU time per run (user+sys of strop, bwrap and
  bwrap's init, which sets up the namespaces and mounts; what a start costs whatever the machine's
  load). It leaves out the processes inside the sandbox (the server shell and the command, ~2 ms
  more here by `perf stat`): close() kills the init, and the kernel reaps the rest of its pid
  namespace itself, reporting their times to no one. And from a warm `SandboxPool` (acquire +
  `true` + release: what a rollout worker pays);
- exec: one more command in a live sandbox, as an argv (`exec_p50_ms`) and as a shell string
  (which runs under `bash -lc`: `exec_shell_p50_ms`);
- a test run: `python -m pytest -q` on a one-test repository in a live sandbox, as the sandbox's
  Python is installed (with pytest's bytecode) and with an empty bytecode cache (`PYTHONPYCACHEPREFIX`
  pointing at a new directory: every module compiled from source, as before the bytecode shipped);
  the policy's visible-test runs and the checker pay this on every episode. And the CPU time of a run
  (a child's rusage, measured by a Python inside the sandbox): started fresh, as every run is, and
  forked from a Python that has imported pytest and its default plugins, running `pytest.main` with
  the same arguments: what a resident test runner would cost a run;
- idle footprint: sandboxes started and left idle up to `--max` (1000) or until the time budget is
  spent; `mib_per_sandbox` is the proportional set size (PSS) of their processes (bwrap, its init and
  the in-sandbox shell), `kernel_mib_per_sandbox` the drop in MemAvailable per sandbox (kernel objects:
  namespaces, mounts, page tables; noisy on a shared machine);
- a spawn from a large process (run as root, which starts bwrap as the sandbox account): `Popen` of
  `true` from a process holding `--ballast-gib` GiB (the RL loop's process holds the engines, their
  models and caches), dropping to the account with Popen's user/group arguments (Python then forks,
  copying the page tables with the GIL held) and through `setpriv` (as `strop.env.sandbox.spawner`
  does: a vfork), with the longest stall of a Python thread ticking beside (an engine's stand-in);
- oracle episodes/s from `strop.env.demonstrators.runs.demonstration_episodes_per_s` when that module exists.

Latencies on a shared machine depend on its load; the load average is recorded with the results.
"""

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick",
        action="store_true",
        help="under a minute: 200 start+exit runs, 50 pooled, 100 execs, 50 step runs a mode, a 5 s "
        "idle-footprint budget, 1 oracle episode",
    )
    p.add_argument(
        "--step-runs", type=int, default=None, help="task sandboxes a mode in the step table (default 200, --quick 50)"
    )
    p.add_argument(
        "--busy-threads", type=int, default=2, help="Python threads spinning beside the step table's second run"
    )
    p.add_argument("--runs", type=int, default=None, help="start+exit runs (default 1000, --quick 200)")
    p.add_argument("--max", type=int, default=1000, help="most idle sandboxes to hold at once (default 1000)")
    p.add_argument("--oracle-episodes", type=int, default=None, help="oracle episodes to time (default 30, --quick 1)")
    p.add_argument(
        "--ballast-gib", type=float, default=2.0, help="memory held while timing a spawn from a large process"
    )
    p.add_argument("--json", help="write results to this JSON file")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def _pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _sandbox_pids(sb) -> list[int]:
    """An idle sandbox's processes: bwrap, its init (pid 1 inside) and the init's children (the server)."""
    init = sb._init_pid()
    try:
        children = [int(c) for c in Path(f"/proc/{init}/task/{init}/children").read_text().split()]
    except OSError:
        children = []
    return [sb.proc.pid, init, *children]


def _mem_available_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return 0


def _cpu_s() -> float:
    """CPU time of this process and its reaped descendants: bwrap and its init, not the processes
    inside the sandbox (see the module docstring)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _start_exit(world: Path, runs: int) -> tuple[list[float], float]:
    """Wall times of `runs` cold start+exits, and the CPU seconds each cost (load-independent: on a
    busy machine wall time is mostly waiting for a core, CPU time is what a start really needs)."""
    from strop.env.sandbox.backend import open_sandbox

    ts = []
    cpu0 = _cpu_s()
    for _ in range(runs):
        t = time.perf_counter()
        sb = open_sandbox(world)
        sb.exec(["true"])
        sb.close()
        ts.append(time.perf_counter() - t)
    return ts, (_cpu_s() - cpu0) / runs


def _pool_start_exit(world: Path, runs: int) -> list[float]:
    from strop.env.sandbox.pool import SandboxPool

    ts = []
    with SandboxPool(world, warm=4) as pool:
        time.sleep(0.5)  # let it warm up
        for _ in range(runs):
            t = time.perf_counter()
            sb = pool.acquire()
            sb.exec(["true"])
            pool.release(sb)
            ts.append(time.perf_counter() - t)
            time.sleep(0.03)  # a rollout works for seconds between sandboxes; the pool refills meanwhile
    return ts


def _exec(world: Path, runs: int) -> tuple[list[float], list[float]]:
    from strop.env.sandbox.backend import open_sandbox

    argv, shell = [], []
    with open_sandbox(world) as sb:
        sb.exec(["true"])
        for _ in range(runs):
            t = time.perf_counter()
            sb.exec(["true"])
            argv.append(time.perf_counter() - t)
        for _ in range(max(20, runs // 5)):
            t = time.perf_counter()
            sb.exec("true")
            shell.append(time.perf_counter() - t)
    return argv, shell


def _test_runs(world: Path, runs: int) -> tuple[list[float], list[float]]:
    """Wall times of `runs` pytest runs in one live sandbox: with the installed bytecode, and
    with none (each run compiles pytest from source, as a read-only site-packages without it did)."""
    from strop.env.sandbox.backend import open_sandbox

    env = {"PYTHONDONTWRITEBYTECODE": "1"}  # nothing written: every run finds what the first found
    out: tuple[list[float], list[float]] = ([], [])
    with open_sandbox(world) as sb:
        for times, prefix in zip(out, ("", 'PYTHONPYCACHEPREFIX="$(mktemp -d)" ')):
            for _ in range(runs):
                t = time.perf_counter()
                r = sb.exec(f"{prefix}python -m pytest -q -p no:cacheprovider tests", env=env)
                times.append(time.perf_counter() - t)
                assert r.exit_code == 0, r.stdout + r.stderr
    return out


# Inside the sandbox: the CPU seconds of RUNS pytest runs started fresh, then of RUNS forked from this
# Python once it has imported pytest and its default plugins (a resident runner's cost per run).
_RUN_CPU = """
import importlib, json, os, subprocess, sys
runs, args = int(sys.argv[1]), ["-q", "-p", "no:cacheprovider", "tests"]
def cpu(pid):
    ru = os.wait4(pid, 0)[2]
    return ru.ru_utime + ru.ru_stime
quiet = os.open(os.devnull, os.O_WRONLY)
fresh = [cpu(subprocess.Popen([sys.executable, "-m", "pytest", *args], stdout=quiet).pid) for _ in range(runs)]
import pytest
from _pytest.config import default_plugins
for name in default_plugins:
    importlib.import_module("_pytest." + name)
forked = []
for _ in range(runs):
    pid = os.fork()
    if pid == 0:
        os.dup2(quiet, 1)
        os._exit(int(pytest.main(args)))
    forked.append(cpu(pid))
print(json.dumps({"fresh": fresh, "forked": forked}))
"""


def _test_run_cpu(world: Path, runs: int) -> dict[str, list[float]]:
    """CPU seconds of `runs` pytest runs in a live sandbox, each started fresh and each forked from
    a Python with pytest imported (`_RUN_CPU`)."""
    import json

    from strop.env.sandbox.backend import open_sandbox

    with open_sandbox(world) as sb:
        r = sb.exec(["python", "-c", _RUN_CPU, str(runs)], timeout=600, env={"PYTHONDONTWRITEBYTECODE": "1"})
    assert r.exit_code == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _idle(world: Path, most: int, budget_s: float) -> dict:
    from strop.env.sandbox.backend import open_sandbox

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # ~4 fds per sandbox on our side
    boxes = []
    mem0 = _mem_available_kib()
    t0 = time.perf_counter()
    try:
        while len(boxes) < most and time.perf_counter() - t0 < budget_s:
            sb = open_sandbox(world)
            sb.exec(["true"])
            boxes.append(sb)
        time.sleep(0.5)
        alive = sum(sb.exec(["true"]).exit_code == 0 for sb in boxes)  # every one still answers
        pss = sum(_pss_kib(pid) for sb in boxes for pid in _sandbox_pids(sb))
        mem1 = _mem_available_kib()
        start_s = time.perf_counter() - t0
    finally:
        for sb in boxes:
            sb.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    n = max(len(boxes), 1)
    return {
        "max_concurrent": alive,
        "mib_per_sandbox": pss / n / 1024,
        # None when other processes freed more memory meanwhile than the sandboxes took
        "kernel_mib_per_sandbox": (mem0 - mem1) / n / 1024 if mem0 > mem1 else None,
        "idle_fill_s": start_s,
    }


def _large_process_spawns(ballast_gib: float, runs: int) -> dict:
    """Median Popen seconds, and a ticking thread's longest stall, per way of dropping to the sandbox
    account, from this process holding `ballast_gib` GiB (see the module docstring); {} unless root."""
    import shutil
    import subprocess
    import threading

    from strop.env.host.account import as_root, sandbox_account

    if not as_root() or shutil.which("setpriv") is None:
        return {}
    ballast = bytearray(int(ballast_gib * (1 << 30)))
    ballast[::4096] = b"\1" * len(ballast[::4096])  # touched: mapped, as a live process's memory is
    uid, gid = sandbox_account()
    ways = {
        "fork": ([], {"user": uid, "group": gid, "extra_groups": []}),
        "vfork": (["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"], {}),
    }
    out = {}
    for name, (prefix, kwargs) in ways.items():
        gaps, spawns, stop = [0.0], [], threading.Event()

        def tick() -> None:
            last = time.perf_counter()
            while not stop.is_set():
                sum(range(1000))
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = threading.Thread(target=tick)
        ticker.start()
        for _ in range(runs):
            t0 = time.perf_counter()
            proc = subprocess.Popen([*prefix, "true"], env={}, stdout=subprocess.DEVNULL, **kwargs)
            spawns.append(time.perf_counter() - t0)
            proc.wait()
        stop.set()
        ticker.join()
        out[f"spawn_{name}_p50_ms"] = _pct(spawns, 0.5)
        out[f"spawn_{name}_stall_max_ms"] = max(gaps) * 1e3
    del ballast
    return out


def _oracle(n: int) -> tuple[float | None, str]:
    try:
        from strop.env.demonstrators.runs import demonstration_episodes_per_s
    except ImportError as e:
        return None, f"strop.env.demonstrators.runs not available ({e})"
    return float(demonstration_episodes_per_s(n)), f"{n} oracle episodes"


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    set_threads(1)
    from strop.bench.sandbox_steps import MODES, STEPS, step_times
    from strop.bench.table import format_table, write_json

    runs = args.runs or (200 if args.quick else 1000)
    t_all = time.perf_counter()
    load = os.getloadavg()[0]
    step_runs = args.step_runs or (50 if args.quick else 200)
    busy = f"{args.busy_threads} busy threads"
    steps = {"idle": step_times(step_runs), busy: step_times(step_runs, args.busy_threads)}
    with tempfile.TemporaryDirectory(prefix="strop-bench-world-") as d:
        world = Path(d)
        (world / "main.py").write_text("print('hello')\n")
        (world / "tests").mkdir()
        (world / "tests" / "test_main.py").write_text("def test_add():\n    assert 1 + 1 == 2\n")
        _start_exit(world, 3)  # warm: per-process setup, the sandbox python cache
        start, start_cpu = _start_exit(world, runs)
        pool = _pool_start_exit(world, 50 if args.quick else 200)
        ex, sh = _exec(world, 100 if args.quick else runs)
        tests, tests_uncached = _test_runs(world, 10 if args.quick else 50)
        run_cpu = _test_run_cpu(world, 10 if args.quick else 50)
        idle = _idle(world, args.max, 5.0 if args.quick else 300.0)
    spawns = _large_process_spawns(args.ballast_gib, 20 if args.quick else 100)
    oracle, oracle_note = _oracle(args.oracle_episodes or (1 if args.quick else 30))
    res = {
        "start_p50_ms": _pct(start, 0.5),
        "start_p99_ms": _pct(start, 0.99),
        "start_min_ms": min(start) * 1e3,
        "start_cpu_ms": start_cpu * 1e3,
        "pool_start_p50_ms": _pct(pool, 0.5),
        "pool_start_p99_ms": _pct(pool, 0.99),
        "exec_p50_ms": _pct(ex, 0.5),
        "exec_p99_ms": _pct(ex, 0.99),
        "exec_shell_p50_ms": _pct(sh, 0.5),
        "pytest_run_p50_ms": _pct(tests, 0.5),
        "pytest_run_no_bytecode_p50_ms": _pct(tests_uncached, 0.5),
        "pytest_run_cpu_p50_ms": _pct(run_cpu["fresh"], 0.5),
        "pytest_run_forked_cpu_p50_ms": _pct(run_cpu["forked"], 0.5),
        **idle,
        **spawns,
        "ballast_gib": args.ballast_gib,
        "oracle_episodes_per_s": oracle,
        "steps": steps,
        "steps_whole_mean_ratio": {
            k: by_mode[MODES[1]]["whole mean_ms"] / by_mode[MODES[0]]["whole mean_ms"] for k, by_mode in steps.items()
        },
        "start_runs": runs,
        "loadavg_1m": load,
        "cpus": os.cpu_count(),
        "wall_s": time.perf_counter() - t_all,
    }
    rows = [
        {
            "measure": "start+exit, cold (open + true + close)",
            "p50": res["start_p50_ms"],
            "p99": res["start_p99_ms"],
            "unit": "ms",
            "n": runs,
        },
        {"measure": "start+exit, cold: fastest run", "p50": res["start_min_ms"], "unit": "ms", "n": runs},
        {"measure": "start+exit, cold: CPU time per run", "p50": res["start_cpu_ms"], "unit": "CPU ms", "n": runs},
        {
            "measure": "start+exit from a warm pool",
            "p50": res["pool_start_p50_ms"],
            "p99": res["pool_start_p99_ms"],
            "unit": "ms",
            "n": len(pool),
        },
        {
            "measure": "exec argv in a live sandbox",
            "p50": res["exec_p50_ms"],
            "p99": res["exec_p99_ms"],
            "unit": "ms",
            "n": len(ex),
        },
        {"measure": "exec shell string (bash -lc)", "p50": res["exec_shell_p50_ms"], "unit": "ms", "n": len(sh)},
        {"measure": "pytest run (one test)", "p50": res["pytest_run_p50_ms"], "unit": "ms", "n": len(tests)},
        {
            "measure": "pytest run, no bytecode (compiled each run)",
            "p50": res["pytest_run_no_bytecode_p50_ms"],
            "unit": "ms",
            "n": len(tests_uncached),
        },
        {
            "measure": "pytest run: CPU time",
            "p50": res["pytest_run_cpu_p50_ms"],
            "unit": "CPU ms",
            "n": len(run_cpu["fresh"]),
        },
        {
            "measure": "pytest run forked from a warm Python: CPU time",
            "p50": res["pytest_run_forked_cpu_p50_ms"],
            "unit": "CPU ms",
            "n": len(run_cpu["forked"]),
        },
        {"measure": "idle sandboxes held at once", "p50": res["max_concurrent"], "unit": "sandboxes"},
        {"measure": "memory per idle sandbox (PSS)", "p50": res["mib_per_sandbox"], "unit": "MiB"},
        {"measure": "kernel memory per idle sandbox", "p50": res["kernel_mib_per_sandbox"], "unit": "MiB"},
        {"measure": "oracle episodes/s", "p50": oracle, "unit": "episodes/s"},
    ]
    for name, how in (("fork", "Popen's user/group: a fork"), ("vfork", "setpriv: a vfork")):
        if f"spawn_{name}_p50_ms" in res:
            rows.append(
                {
                    "measure": f"spawn from {args.ballast_gib:g} GiB, {how}",
                    "p50": res[f"spawn_{name}_p50_ms"],
                    "unit": "ms",
                }
            )
            rows.append(
                {"measure": "  a Python thread's longest stall", "p50": res[f"spawn_{name}_stall_max_ms"], "unit": "ms"}
            )
    print(format_table(rows, ["measure", "p50", "p99", "unit", "n"]))
    columns = {f"{m}, {k}": (k, m) for k in steps for m in MODES}
    step_rows = [
        {"step (p50 ms)": step, **{c: steps[k][m][f"{step} p50_ms"] for c, (k, m) in columns.items()}}
        for step in (*STEPS, "whole")
    ]
    step_rows.append(
        {"step (p50 ms)": "whole (mean ms)", **{c: steps[k][m]["whole mean_ms"] for c, (k, m) in columns.items()}}
    )
    print(format_table(step_rows, ["step (p50 ms)", *columns]))
    ratios = ", ".join(f"{k} {r:.2f}" for k, r in res["steps_whole_mean_ratio"].items())
    print(f"a task sandbox's open, first command and close, shared / fresh copy (means): {ratios}")
    print(f"load average {load:.2f} on {os.cpu_count()} CPUs; oracle: {oracle_note}; {res['wall_s']:.1f} s")
    write_json(args.json, res)
    return 0
