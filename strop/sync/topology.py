"""A fan-out topology on this machine: trainer -> origin -> one relay per cluster -> engines.

Everything talks HTTP over 127.0.0.1 with token-bucket links: the origin-to-relay links stand
for the trainer's WAN egress, the relay-to-engine links for each cluster's LAN. Engines are
threads, each holding a `Replica` that long-polls its relay and walks the chain. The trainer
publishes `versions` real deltas (synthetic AdamW steps on a few bf16 tensors) and the run
reports, per version, the trainer's egress (deltas and bytes the origin sent), the time until
every engine held the version verified, and each engine's pause (the in-place write).
"""

import tempfile
import threading
import time
from dataclasses import dataclass

import numpy as np

from strop.sync.relay import Origin, Relay, fetcher, get
from strop.sync.replica import Patch, Replica
from strop.sync.store import Publisher, Store
from strop.sync.synthetic import adamw_snapshots
from strop.sync.tensors import Tensor


@dataclass
class FanoutResult:
    clusters: int
    engines_per_cluster: int
    versions: int
    params: int
    delta_bytes: list[int]  # per version
    egress_deltas: list[int]  # deltas the origin sent, per version (ideal: one per cluster)
    egress_bytes: list[int]
    time_to_all_engines_s: list[float]
    pause_ms_median: float  # in-place writes; engines are threads of one process here, so the
    pause_ms_max: float  # maximum includes waits for the GIL held by other engines' decoding
    bit_exact: bool


def _model(params: int, versions: int, lr: float) -> list[dict[str, Tensor]]:
    """`versions`+1 states of a 4-tensor bf16 model stepping under AdamW."""
    sizes = {"embed": params // 2, "attn": params // 4, "mlp": params // 8, "head": params // 8}
    snaps = {k: adamw_snapshots(n, lr, steps=versions, keep=tuple(range(versions + 1)), seed=i)
             for i, (k, n) in enumerate(sizes.items())}
    return [{k: Tensor("BF16", (n,), snaps[k][v]) for k, n in sizes.items()} for v in range(versions + 1)]


def run_fanout(clusters: int = 4, engines_per_cluster: int = 3, versions: int = 3, params: int = 1_000_000,
               lr: float = 1e-5, wan_mb_s: float = 50.0, lan_mb_s: float = 200.0, root: str | None = None) -> FanoutResult:
    states = _model(params, versions, lr)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(root or tmp)
        pub = Publisher(store)
        pub.publish(states[0])
        origin = Origin(store, wan_mb_s * 1e6).start()
        relays = [Relay(origin.url, lan_mb_s * 1e6).start() for _ in range(clusters)]
        reached: dict[tuple[int, int], float] = {}  # (engine, version) -> time it held it
        pauses: list[float] = []
        replicas = [Replica.bootstrap(store) for _ in range(clusters * engines_per_cluster)]
        lock = threading.Lock()

        def engine(i: int) -> None:
            r, relay = replicas[i], relays[i // engines_per_cluster]
            fetch = fetcher(relay.url)

            def apply(p: Patch) -> None:
                t = time.perf_counter()
                p.apply(r.state)
                now = time.perf_counter()
                with lock:
                    pauses.append(now - t)
                    reached[i, p.version] = now

            while r.version < versions:
                head = int(get(f"{relay.url}/head?after={r.version}"))
                if head > r.version:
                    r.advance(store, target=head, fetch=fetch, apply=apply)

        threads = [threading.Thread(target=engine, args=(i,), daemon=True) for i in range(len(replicas))]
        for t in threads:
            t.start()
        published, sizes, egress, egress_bytes = [], [], [], []
        for v in range(1, versions + 1):
            before = (origin.sent_deltas, origin.sent_bytes)
            pub.publish(states[v])
            published.append(time.perf_counter())
            origin.notify()
            sizes.append(store.manifest(v).nbytes)
            while not all((i, v) in reached for i in range(len(replicas))):
                time.sleep(0.002)
            egress.append(origin.sent_deltas - before[0])
            egress_bytes.append(origin.sent_bytes - before[1])
        for t in threads:
            t.join(timeout=30)
        for node in (*relays, origin):
            node.close()
        exact = all(np.array_equal(r.state[k].data, states[-1][k].data) for r in replicas for k in states[-1])
    ttae = [max(reached[i, v] for i in range(len(replicas))) - published[v - 1] for v in range(1, versions + 1)]
    return FanoutResult(clusters, engines_per_cluster, versions, params, sizes, egress, egress_bytes, ttae,
                        1e3 * float(np.median(pauses)), 1e3 * max(pauses), exact)
