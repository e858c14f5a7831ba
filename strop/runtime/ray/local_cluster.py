"""A multi-node Ray cluster on this one machine, labelled as strop places a run: a head node for
the trainer cluster (`strop-role=trainer`, the driver connects there) and one node per inference
cluster (`strop-cluster=<name>`). Each node is a real raylet with its own object store and
workers (`ray.cluster_utils.Cluster`), so actors placed by label run in another node's processes
and reach each other over the node's address, as on separate machines. For tests and
`strop bench scaleout`; on a real cluster, label nodes with `ray start --labels` (see README)."""

import contextlib
from collections.abc import Iterator

from strop.runtime.ray.placement import CLUSTER_LABEL, ROLE_LABEL, TRAINER_ROLE

OBJECT_STORE_BYTES = 100 * 1024**2  # per node; strop's actors pass metrics and trajectories only


@contextlib.contextmanager
def local_cluster(inference_clusters: list[str], cpus_per_node: int = 1) -> Iterator[str]:
    """Start the nodes, connect this process to the head, yield its address; shut all down after."""
    import ray
    from ray.cluster_utils import Cluster

    node = {"num_cpus": cpus_per_node, "object_store_memory": OBJECT_STORE_BYTES}
    cluster = Cluster(
        initialize_head=True, head_node_args={**node, "include_dashboard": False, "labels": {ROLE_LABEL: TRAINER_ROLE}}
    )
    try:
        for name in inference_clusters:
            cluster.add_node(**node, labels={ROLE_LABEL: "inference", CLUSTER_LABEL: name})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster.address
    finally:
        ray.shutdown()
        cluster.shutdown()
