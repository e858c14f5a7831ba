"""The trainer's end of the weight transport, living in the trainer's own process.

Every runtime hands the trainer one of these as its `publish(version, bf16_state_dict)`
callback. Each version is encoded here — a lossless delta against the previous version, or the
whole snapshot in the same file format with `full` — written to the versioned store (a
directory or any fsspec URL), and announced by the origin, an HTTP endpoint in this process
that serves it once to each inference cluster's relay. So what leaves the trainer for a version
after the first is that file, one copy per cluster, and `bytes_sent` counts exactly those bytes
(plus the single tensors receivers ask the origin for when they repair).

Old deltas are folded into the store's snapshot as they age (`keep_deltas`); see
`store.Publisher.gc`.

A sharded trainer has one on every rank (`ranks`): each encodes the delta of its own shards as its
piece of the version (`publish_shards`, `strop.sync.pieces`), so no rank gathers the model; rank 0
alone serves (the origin), and seals each version once every rank has written its piece.
"""

import time

import torch

from strop.sync.apply import bits_view
from strop.sync.pieces import piece_name
from strop.sync.relay import Origin
from strop.sync.store import Publisher, Store
from strop.sync.tensors import Tensor, to_bytes

Shards = dict[str, tuple[tuple[int, ...], int, torch.Tensor]]  # name -> (whole shape, flat offset, this rank's shard)


class TrainerSync:
    """`publish(version, state)` as the trainer calls it; `origin_url` is where relays pull from.
    `wan_bytes_per_s` paces each response to a relay (a token bucket standing for a WAN link).
    `ranks`: the rank group of a sharded trainer (`rank`, and `gather(obj)` -> every rank's, on every
    rank), whose ranks each publish their shards; only rank 0 has an origin."""

    def __init__(
        self,
        store_url: str,
        *,
        full: bool = False,
        keep_deltas: int = 8,
        wan_bytes_per_s: float | None = None,
        host: str = "127.0.0.1",
        ranks=None,
    ):
        self.store_url = store_url
        self.ranks = ranks
        self.publisher = Publisher(Store(store_url), full=full, piece=None if ranks is None else ranks.rank)
        self.keep_deltas = keep_deltas
        serves = ranks is None or ranks.rank == 0
        self.origin = Origin(self.publisher, wan_bytes_per_s, host).start() if serves else None
        self.origin_url = self.origin.url if serves else None
        self.published_at: dict[int, float] = {}  # version -> time.time() it was announced
        self.file_bytes: dict[int, int] = {}  # version -> size of what was published (delta, or the snapshot)

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Encode `state` (bf16) against the previous version, store it, announce it."""
        self.publisher.publish({k: bits_view(v.detach().contiguous()) for k, v in state.items()}, version)
        self.file_bytes[version] = self.publisher.nbytes
        self.publisher.gc(self.keep_deltas)
        self.published_at[version] = time.time()
        self.origin.notify()

    def publish_shards(self, version: int, shards: Shards) -> None:
        """Every rank of a sharded trainer: encode this rank's shards (bf16) against its previous ones
        as its piece of `version` and store it; then rank 0 seals the version (its manifest, with each
        whole tensor's crc combined from the pieces') and announces it. Only crcs are gathered."""
        ranks, pub = self.ranks, self.publisher
        state, shapes = {}, {}
        for name, (shape, start, shard) in shards.items():
            bits = bits_view(shard.detach().contiguous())
            key = piece_name(name, start, start + len(bits.data))
            state[key], shapes[key] = Tensor(bits.dtype, (len(bits.data),), bits.data), tuple(shape)
        base_version = None if pub.state is None else pub.version
        if base_version is None:  # a new chain: the old one is gone before any rank writes a piece of it
            if ranks.rank == 0:
                pub.store.clear()
            ranks.gather(None)
        pub.publish(state, version)
        keys = {k: (t.dtype, shapes[k], pub.crcs[k], t.nbytes) for k, t in state.items()}
        parts = ranks.gather((pub.nbytes, keys))
        folded = None
        if ranks.rank == 0:
            self.file_bytes[version] = pub.store.seal(version, base_version, parts).nbytes
            folded = pub.gc(self.keep_deltas)
        if not ranks.gather(folded)[0]:  # the chain cannot be folded: cut it at every rank's own pieces
            blob = to_bytes(pub.state)
            pub.store.put_piece(blob, version, ranks.rank, snapshot=True)
            sizes = ranks.gather(len(blob))
            if ranks.rank == 0:
                pub.store.cut(version, sum(sizes))
        if ranks.rank == 0:
            self.published_at[version] = time.time()
            self.origin.notify()

    def restart(self) -> None:
        """The next version published starts a new chain (a resumed trainer's weights)."""
        self.publisher.restart()

    def stats(self) -> dict:
        """Egress so far (bytes and deltas the origin sent, per version too), each version's file size
        and the time it was announced."""
        o = self.origin
        if o is None:
            return {}
        with o.cond:
            by_version = {v: [o.sent_by_version[v], o.sent_bytes_by_version[v]] for v in sorted(o.sent_by_version)}
            return {
                "version": self.publisher.version,
                "bytes_sent": o.sent_bytes,
                "deltas_sent": o.sent_deltas,
                "sent_by_version": by_version,
                "file_bytes": dict(self.file_bytes),
                "published_at": dict(self.published_at),
            }

    def close(self) -> None:
        if self.origin is not None:
            self.origin.close()
