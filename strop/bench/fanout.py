"""A fan-out topology on this machine, through the real transport: the trainer's `TrainerSync`
(store + origin) -> one `Relay` per cluster -> engines (`EngineSync` threads on live bf16 tensors).

Everything talks HTTP over 127.0.0.1 with token-bucket links: the origin-to-relay links stand
for the trainer's WAN egress, the relay-to-engine links for each cluster's LAN. The trainer
publishes `versions` real deltas (synthetic AdamW steps on a few bf16 tensors) and the run
reports, per version, the trainer's egress (deltas and bytes the origin sent), the time until
every engine held the version verified, and each engine's pause (the in-place write).
"""

import tempfile
import threading
from dataclasses import dataclass

import numpy as np
import torch

from strop.sync.apply import EngineSync
from strop.sync.publisher import TrainerSync
from strop.sync.relay import Relay, http_link
from strop.sync.synthetic import adamw_snapshots


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


def _model(params: int, versions: int, lr: float) -> list[dict[str, torch.Tensor]]:
    """`versions`+1 states of a 4-tensor bf16 model stepping under AdamW."""
    sizes = {"embed": params // 2, "attn": params // 4, "mlp": params // 8, "head": params // 8}
    snaps = {
        k: adamw_snapshots(n, lr, steps=versions, keep=tuple(range(versions + 1)), seed=i)
        for i, (k, n) in enumerate(sizes.items())
    }
    return [
        {k: torch.from_numpy(snaps[k][v].view(np.int16).copy()).view(torch.bfloat16) for k in sizes}
        for v in range(versions + 1)
    ]


def run_fanout(
    clusters: int = 4,
    engines_per_cluster: int = 3,
    versions: int = 3,
    params: int = 1_000_000,
    lr: float = 1e-5,
    wan_mb_s: float = 50.0,
    lan_mb_s: float = 200.0,
) -> FanoutResult:
    states = _model(params, versions, lr)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = TrainerSync(tmp, keep_deltas=0, wan_bytes_per_s=wan_mb_s * 1e6)
        trainer.publish(0, states[0])
        relays = [Relay(trainer.origin_url, lan_mb_s * 1e6).start() for _ in range(clusters)]
        engines = [
            EngineSync({k: t.clone() for k, t in states[0].items()}, version=-1)
            for _ in range(clusters * engines_per_cluster)
        ]
        stop = threading.Event()
        threads = [
            threading.Thread(
                target=e.follow,
                daemon=True,
                args=(
                    trainer.publisher.store,
                    http_link(relays[i // engines_per_cluster].url),
                    trainer.origin_url,
                    stop,
                ),
            )
            for i, e in enumerate(engines)
        ]
        for t in threads:
            t.start()
        assert all(e.wait_version(0, 60) for e in engines)
        for v in range(1, versions + 1):
            trainer.publish(v, states[v])
            assert all(e.wait_version(v, 60) for e in engines), f"version {v} did not reach every engine"
        stats = trainer.stats()
        sizes = [trainer.publisher.store.manifest(v).nbytes for v in range(1, versions + 1)]
        stop.set()
        for node in (*relays, trainer):
            node.close()
        for t in threads:
            t.join(timeout=30)
        exact = all(
            torch.equal(e.live[k].view(torch.int16), states[-1][k].view(torch.int16))
            for e in engines
            for k in states[-1]
        )
    per = stats["sent_by_version"]
    ttae = [max(e.swapped_at[v] for e in engines) - trainer.published_at[v] for v in range(1, versions + 1)]
    pauses = [p for e in engines for p in e.pauses[1:]]  # [0] is the bootstrap (nothing to change)
    return FanoutResult(
        clusters,
        engines_per_cluster,
        versions,
        params,
        sizes,
        [per.get(v, [0, 0])[0] for v in range(1, versions + 1)],
        [per.get(v, [0, 0])[1] for v in range(1, versions + 1)],
        ttae,
        1e3 * float(np.median(pauses)),
        1e3 * max(pauses),
        exact,
    )
