"""`strop bench envs`: what a real world costs on this machine.

- sandbox start+exit (`open_sandbox` + `true` + `close`, cold) on an OS image's unpacked root and on
  the host's root, in the same run, alternating one of each so that the machine's load falls on
  both alike: p50 and p99, and their ratio (`image_vs_host_start_p50`);
- materialising a repository at a commit (`strop.env.world.repo.checkout`): cold (a commit never
  checked out on this node, the source's mirror already cloned: what each new task's first
  episode pays), the mirror's clone (a source's first use on a node), and cached: looked up by a
  process that has not seen the commit (a new rollout worker; `_in_process`: every later lookup);
- mining (`strop.env.tasks.mine`): tasks kept and wall seconds per candidate commit (two test runs in the
  image, and for a kept one its validation).

The worlds: `--image` and `--repo` (a git repository or bundle), by default those of
`strop.bench.worlds` (an OCI image assembled from this machine's Debian python3 and pytest, and a
repository with fix-and-test commits, as the tests use), so `--quick` runs wherever strop does.
The bench runs on a node cache of its own (`STROP_CACHE`, a fresh directory removed at the end),
so cold is cold on every run: the image is unpacked again (`image_unpack_s`), the source's mirror
cloned and every commit checked out for the first time.

Latencies on a shared machine depend on its load; the load average is recorded with the results.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from strop.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="about a minute: 40 starts of each, 3 commits to mine")
    p.add_argument("--image", help="OS image to measure (default: the test kit's small image)")
    p.add_argument("--repo", help="git repository or bundle to materialise and mine (default: the test kit's)")
    p.add_argument("--runs", type=int, help="start+exit runs of each root (default 300, --quick 40)")
    p.add_argument("--commits", type=int, help="commits to materialise cold (default 20, --quick 4)")
    p.add_argument("--max-commits", type=int, help="newest commits of --repo to mine (default 40; all of the kit's)")
    p.add_argument("--jobs", type=int, default=1, help="commits mined at once (default 1)")
    p.add_argument(
        "--tests", choices=["modules", "touched"], default="modules", help="which tests mining runs (strop tasks mine)"
    )
    p.add_argument("--json", help="write results to this JSON file")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def _default_worlds(tmp: Path) -> tuple[str, str]:
    from strop.bench import worlds as kit

    if kit.host_python() is None:
        raise UserError("the default image is built from this machine's Debian python3, which it lacks: give --image")
    layers = [kit.base_layer(tmp / "base.tar"), kit.top_layer(tmp / "top.tar")]
    image = kit.oci_layout(tmp / "image", layers)
    kit.fix_and_test_repo(tmp / "calc")
    return str(image), str(tmp / "calc")


def _starts(image_root: str, world: Path, runs: int) -> tuple[list[float], list[float]]:
    """Wall times of `runs` cold start+exits on the image's root and on the host's, alternating."""
    from strop.env.sandbox.backend import open_sandbox
    from strop.env.world.image import HOST_ROOT

    times: dict[str, list[float]] = {image_root: [], HOST_ROOT: []}
    for i in range(runs * 2):
        root = (image_root, HOST_ROOT)[i % 2]
        t = time.perf_counter()
        sb = open_sandbox(world, image=root)
        sb.exec(["true"])
        sb.close()
        times[root].append(time.perf_counter() - t)
    return times[image_root], times[HOST_ROOT]


def _commits(source: str, n: int) -> list[str]:
    from strop.env.world.repo import git, history

    mirror, sha = history(source)
    return git("rev-list", f"--max-count={n}", sha, cwd=mirror).split()


_LOOKUP = (
    "import sys, time\n"
    "from strop.env.world.repo import checkout\n"
    "t = time.perf_counter()\n"
    "checkout(sys.argv[1], sys.argv[2])\n"
    "print(time.perf_counter() - t)\n"
)


def _materialise(source: str, n: int) -> dict:
    """Cold and cached checkouts of `source`'s newest `n` commits (the node cache is the bench's own)."""
    from strop.env.world.repo import checkout, history

    t = time.perf_counter()
    history(source)
    mirror_s = time.perf_counter() - t
    commits = _commits(source, n)
    cold, cached = [], []
    for sha in commits:
        t = time.perf_counter()
        checkout(source, sha)
        cold.append(time.perf_counter() - t)
    for _ in range(5):
        for sha in commits:
            t = time.perf_counter()
            checkout(source, sha)
            cached.append(time.perf_counter() - t)
    # a process that has not looked the commit up yet (a new rollout worker): git finds it in the
    # mirror, the tree is on disk already
    lookup = [sys.executable, "-c", _LOOKUP, source]
    fresh = [
        float(subprocess.run([*lookup, sha], capture_output=True, text=True, check=True).stdout) for sha in commits[:5]
    ]
    return {
        "repo_materialise_ms_cold": statistics.median(cold) * 1e3,
        "repo_materialise_ms_cached": statistics.median(fresh) * 1e3,
        "repo_materialise_ms_cached_in_process": statistics.median(cached) * 1e3,
        "repo_mirror_ms": mirror_s * 1e3,
        "repo_commits_materialised": len(commits),
    }


def _mine(source: str, image: str, max_commits: int | None, jobs: int, tests: str) -> dict:
    from strop.env.tasks.mine import mine

    with tempfile.TemporaryDirectory(prefix="strop-bench-mine-") as tmp:
        t = time.perf_counter()
        out = Path(tmp) / "tasks.jsonl"
        report = mine(source, out, image=image, max_commits=max_commits, jobs=jobs, tests=tests)
        wall = time.perf_counter() - t
    return {
        "mine_tasks_kept": report["kept"],
        "mine_candidates": report["candidates"],
        "mine_commits_walked": report["commits_walked"],
        "mine_s_per_commit": wall / max(report["candidates"], 1),
        "mine_dropped": report["dropped"],
    }


def _measure(args: argparse.Namespace, runs: int) -> dict:
    from strop.env.host.account import hand_over
    from strop.env.host.scratch import scratch_base
    from strop.env.world.image import image_root

    n_commits = args.commits or (4 if args.quick else 20)
    t_all = time.perf_counter()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="strop-bench-envs-", dir=scratch_base()) as tmp:
        os.chmod(tmp, 0o755)  # the sandbox account enters it to reach the world below
        kit_image, kit_repo = _default_worlds(Path(tmp)) if not (args.image and args.repo) else ("", "")
        image, source = args.image or kit_image, args.repo or kit_repo
        t = time.perf_counter()
        root = image_root(image)
        unpack_s = time.perf_counter() - t
        world = Path(tmp) / "world"
        world.mkdir()
        (world / "main.py").write_text("print('hello')\n")
        hand_over(world)
        _starts(root, world, 3)  # warm: per-process setup, the page cache of both roots
        image_starts, host_starts = _starts(root, world, runs)
        res = {
            "image_sandbox_start_ms_p50": _pct(image_starts, 0.5),
            "image_sandbox_start_ms_p99": _pct(image_starts, 0.99),
            "host_sandbox_start_ms_p50": _pct(host_starts, 0.5),
            "host_sandbox_start_ms_p99": _pct(host_starts, 0.99),
        }
        res["image_vs_host_start_p50"] = res["image_sandbox_start_ms_p50"] / res["host_sandbox_start_ms_p50"]
        res.update(_materialise(source, n_commits))
        res.update(_mine(source, image, args.max_commits or (None if not args.repo else 40), args.jobs, args.tests))
    res.update(
        {
            "image": image if args.image else "test kit image",
            "repo": source if args.repo else "test kit repository",
            "image_unpack_s": unpack_s,  # into the bench's own (empty) node cache
            "mine_tests": args.tests,
            "mine_jobs": args.jobs,
            "start_runs": runs,
            "loadavg_1m": load,
            "cpus": os.cpu_count(),
            "wall_s": time.perf_counter() - t_all,
        }
    )
    return res


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    set_threads(1)
    from strop.bench.table import format_table, write_json
    from strop.env.host.node_cache import node_cache

    if args.json:
        from strop.outputs import check_output_file

        check_output_file(args.json)
    runs = args.runs or (40 if args.quick else 300)
    # a node cache of the bench's own, removed at the end: every cold figure is cold, on every run
    cache = Path(tempfile.mkdtemp(prefix="bench-envs-", dir=node_cache()))
    os.chmod(cache, 0o755)
    before = os.environ.get("STROP_CACHE")
    os.environ["STROP_CACHE"] = str(cache)
    try:
        res = _measure(args, runs)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if before is None:
            os.environ.pop("STROP_CACHE")
        else:
            os.environ["STROP_CACHE"] = before
    rows = [
        {
            "measure": "sandbox start+exit on the image",
            "p50": res["image_sandbox_start_ms_p50"],
            "p99": res["image_sandbox_start_ms_p99"],
            "unit": "ms",
            "n": runs,
        },
        {
            "measure": "sandbox start+exit on the host root",
            "p50": res["host_sandbox_start_ms_p50"],
            "p99": res["host_sandbox_start_ms_p99"],
            "unit": "ms",
            "n": runs,
        },
        {"measure": "image / host start (p50)", "p50": res["image_vs_host_start_p50"], "unit": "ratio"},
        {
            "measure": "repository at a commit, cold",
            "p50": res["repo_materialise_ms_cold"],
            "unit": "ms",
            "n": res["repo_commits_materialised"],
        },
        {
            "measure": "repository at a commit, cached (new process)",
            "p50": res["repo_materialise_ms_cached"],
            "unit": "ms",
            "n": min(5, res["repo_commits_materialised"]),
        },
        {"measure": "a source's first use (mirror clone)", "p50": res["repo_mirror_ms"], "unit": "ms", "n": 1},
        {
            "measure": "tasks kept by mining",
            "p50": res["mine_tasks_kept"],
            "unit": "tasks",
            "n": res["mine_candidates"],
        },
        {
            "measure": "mining, wall time per candidate commit",
            "p50": res["mine_s_per_commit"],
            "unit": "s",
            "n": res["mine_candidates"],
        },
    ]
    print(format_table(rows, ["measure", "p50", "p99", "unit", "n"]))
    print(f"image {res['image']}; repository {res['repo']}; dropped {res['mine_dropped']}")
    print(f"load average {res['loadavg_1m']:.2f} on {os.cpu_count()} CPUs; {res['wall_s']:.1f} s")
    write_json(args.json, res)
    return 0
