"""A trainer sharded over local processes: rank 0 is the trainer a runtime talks to; ranks
1..N-1 are spawned worker processes that mirror each of its calls.

    runtime ──call──► rank 0 ──broadcast (call, args)──► rank 1 .. N-1
                        │  every rank runs the call: its share of a step, its part of a gather
                        └─► answer (rank 0's)

`strop.train.parallel.start_ranks` spawns the workers, joins the process group as rank 0
and returns the rank group; each worker runs `target(ranks, *args)`: for a `RankedTrainer`,
`follow_calls`, which builds its own trainer with the same `build(ranks, *args)` rank 0 uses and
runs rank 0's calls on it; for SFT, the same training loop rank 0 runs. `RankedTrainer` is rank
0's trainer with the calls of `strop.runtime.trainers.LocalTrainer`, each sent to every rank
first, so the collectives inside (FSDP's all-gathers and reduce-scatters, the metrics' gathers)
line up. Samples reach the
workers by that broadcast; weights never travel over it.
"""

from typing import Callable

from strop.train.parallel import Ranks, stop_ranks


def follow_calls(ranks: Ranks, build: Callable, args: tuple) -> None:
    """A worker of a `RankedTrainer`: build this rank's trainer, run rank 0's calls on it as they
    are broadcast, until rank 0 broadcasts None."""
    local = build(ranks, *args)
    try:
        while (msg := ranks.broadcast()) is not None:
            call, call_args = msg
            getattr(local, call)(*call_args)
    finally:
        local.close()


class RankedTrainer:
    """Rank 0 of a sharded trainer, with `LocalTrainer`'s calls: each runs on every rank, and
    what comes back is rank 0's answer."""

    def __init__(self, local, ranks: Ranks, procs: list):
        self.local, self.ranks, self.procs = local, ranks, procs
        self.origin_url = local.origin_url

    def _all(self, call: str, *args):
        self.ranks.broadcast((call, args))
        return getattr(self.local, call)(*args)

    @property
    def version(self) -> int:
        return self.local.version

    def step(self, samples) -> dict:
        return self._all("step", samples)

    def publish(self) -> None:
        self._all("publish")

    def state_dict(self) -> dict:
        return self._all("state_dict")

    def save(self, path) -> None:
        self._all("save", path)  # every rank writes its shards; rank 0 returns once all are written

    def load(self, path) -> None:
        self._all("load", path)

    def bf16_state_dict(self):
        return self._all("bf16_state_dict")

    def memory(self) -> list[dict]:
        return self._all("memory")

    def sync_stats(self) -> dict:
        return self.local.sync_stats()  # rank 0's transport: no collective

    def close(self) -> None:
        self.ranks.broadcast(None)
        self.local.close()
        stop_ranks(self.procs)
