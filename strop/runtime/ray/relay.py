"""One inference cluster's relay as a Ray actor: a light process (no torch) on a node of that
cluster, pulling each version once from the trainer's origin and serving the cluster's engines."""

import ray


@ray.remote(num_cpus=0)
class RelayActor:
    def __init__(self, upstream: str, lan_bytes_per_s: float | None, keep: int):
        from strop.sync.relay import Relay

        self.relay = Relay(upstream, lan_bytes_per_s, keep, host=ray.util.get_node_ip_address()).start()

    def url(self) -> str:
        return self.relay.url

    def stats(self) -> dict:
        """Bytes it pulled from the trainer side, and what it served its engines."""
        r = self.relay
        return {
            "pulled_bytes": r.pulled_bytes,
            "sent_bytes": r.sent_bytes,
            "sent_deltas": r.sent_deltas,
            "node": ray.get_runtime_context().get_node_id(),
        }
