"""Fan-out over real HTTP on 127.0.0.1: one delta per cluster leaves the trainer."""

import time

from strop.bench.fanout import run_fanout
from strop.sync.relay import Origin, Relay, TokenBucket, get
from strop.sync.store import Publisher, Store
from strop.sync.synthetic import adamw_snapshots
from strop.sync.tensors import Tensor


def test_four_clusters_trainer_egress_is_one_delta_per_cluster():
    res = run_fanout(clusters=4, engines_per_cluster=3, versions=2, params=200_000)
    assert res.bit_exact
    assert res.egress_deltas == [4, 4]
    assert res.egress_bytes == [4 * b for b in res.delta_bytes]
    assert all(t < 10 for t in res.time_to_all_engines_s)


def test_token_bucket_limits_rate():
    b = TokenBucket(rate=1e6, burst=10_000)
    t = time.perf_counter()
    for _ in range(20):
        b.take(10_000)
    assert time.perf_counter() - t > 0.15  # 200 kB at 1 MB/s, less one burst


def test_relay_pulls_once_for_many_requests(tmp_path):
    store = Store(str(tmp_path))
    pub = Publisher(store)
    snaps = adamw_snapshots(50_000, 1e-5, steps=1, keep=(0, 1))
    for v in (0, 1):
        pub.publish({"w": Tensor("BF16", (50_000,), snaps[v])})
    origin = Origin(pub).start()
    origin.notify()
    relay = Relay(origin.url).start()
    try:
        bodies = {get(f"{relay.url}/delta/1") for _ in range(5)}
        assert bodies == {store.delta_bytes(1)}
        assert origin.sent_deltas == 1
        assert int(get(f"{relay.url}/head?after=-1")) == 1
    finally:
        relay.close()
        origin.close()
