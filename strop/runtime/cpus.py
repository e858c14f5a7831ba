"""How a run splits this machine's cores between the trainer and the engines with their rollouts
(`split_cores`), and pinning a thread to its share (`pin`)."""

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
