"""How a run splits this machine's cores between the trainer and the engines with their rollouts
(`split_cores`), pinning a thread to its share (`pin`), and who used them (`cpu_reading`)."""

import os
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuSplit:
    trainer: frozenset[int]
    rollout: frozenset[int]


def split_cores(share: bool = False) -> CpuSplit | None:
    """The trainer on the first allowed core, engines and rollouts on the others (None on one core).

    `share`: trainer, engines and rollouts all on every core. On a small machine neither side is
    busy all the time (which one waits depends on how many groups have mixed outcomes, the rows the
    trainer learns from), and a core one side leaves idle goes to the other: the trainer's threads
    wait passively (`strop.runtime.trainers.TrainerProcess`), so its second thread costs an engine
    little. The dedicated split is for measuring each component against its own hardware."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    if share:
        return CpuSplit(frozenset(cpus), frozenset(cpus))
    return CpuSplit(frozenset(cpus[:1]), frozenset(cpus[1:]))


def pin(cpus: frozenset[int] | None) -> None:
    """Pin the calling thread (not the process: Linux affinity is per thread) to `cpus`."""
    if cpus:
        os.sched_setaffinity(threading.get_native_id(), cpus)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds process `pid` has used so far (Linux's /proc; 0.0 where unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu_s() -> tuple[float, float]:
    """(busy, unused) CPU seconds of the whole machine so far, summed over its cores (Linux's
    /proc/stat: user, nice, system, irq and softirq are busy; idle, iowait and a VM's steal are not);
    (0.0, 0.0) where unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0.0, 0.0
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, (idle + iowait + steal) / tick


def cpu_reading(trainer_pid: int | None) -> dict[str, float]:
    """CPU seconds used so far, by whom: `trainer`, the trainer's own process (0 where it runs in
    this one); `loop`, this process (engines, rollout threads, the loop, and the trainer when it runs
    here); `busy` and `unused`, the whole machine's (`machine_cpu_s`). What the machine's busy
    seconds hold beyond the two processes is the run's sandboxes, with the tools and tests run in
    them, and its checks: their processes are reaped inside their sandboxes' namespaces, where no
    resource usage of this process's children sees them (and a sharded trainer's other ranks, and
    whatever else the machine runs)."""
    t = os.times()
    busy, unused = machine_cpu_s()
    return {
        "trainer": process_cpu_s(trainer_pid) if trainer_pid else 0.0,
        "loop": t.user + t.system,
        "busy": busy,
        "unused": unused,
    }
