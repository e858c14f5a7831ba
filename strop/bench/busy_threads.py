"""Python threads that keep the GIL busy beside a measurement, as an RL run's rollout workers and
second engine do beside an engine or a sandbox spawn (`strop bench sandbox`, `strop bench
engine-threads`)."""

import contextlib
import threading
import time
from collections.abc import Iterator


@contextlib.contextmanager
def busy_threads(threads: int, duty: float = 1.0, period_s: float = 0.002) -> Iterator[None]:
    """`threads` Python threads running pure Python until the block exits: all the time (`duty` 1),
    or `duty` of every `period_s` and asleep for the rest."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            if duty >= 1:
                sum(range(1000))
                continue
            t = time.perf_counter()
            while time.perf_counter() - t < duty * period_s:
                sum(range(200))
            time.sleep((1 - duty) * period_s)

    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(threads)]
    for t in spinners:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in spinners:
            t.join()
