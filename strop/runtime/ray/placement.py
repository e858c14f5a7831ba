"""Where strop's Ray actors go: node labels, and what each actor asks Ray's scheduler for.

Nodes are labelled when they join (`ray start --labels ...`; `strop.runtime.ray.local_cluster` on one
machine): `strop-role=trainer` marks the trainer nodes, `strop-cluster=<name>` the nodes of an
inference cluster. Without labels (a local Ray instance) everything is one cluster on any node.

Actors ask for no CPUs (their threads are pinned by `cpus`, when given), so a small machine can
hold them all; a trainer rank on a GPU node asks for one GPU, and the ranks are reserved together
in a placement group (`trainer_placement`): all of them are placed, or none. A vLLM engine on an
inference cluster with GPUs asks for one (`engine_resources`).
"""

import os

import ray

from strop.config import RolloutSection, TrainerSection
from strop.errors import UserError

ROLE_LABEL, TRAINER_ROLE = "strop-role", "trainer"
CLUSTER_LABEL = "strop-cluster"
UNLABELLED = "default"  # the one inference cluster of a cluster without strop-cluster labels
BUNDLE_CPU = 0.001  # a placement-group bundle must ask for something; a rank's CPU share is its pinned cores
PLACEMENT_TIMEOUT_S = 120.0  # trainer ranks that cannot all be placed by then never will be


def start_actor_process(cpus: frozenset[int] | None) -> None:
    """First thing in every actor: one torch thread, pinned to `cpus` when given."""
    from strop.threads import set_threads

    set_threads(1)
    if cpus:
        os.sched_setaffinity(0, cpus)  # the actor's main thread; threads it starts inherit it


def live_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n["Alive"]]


def cluster_layout() -> tuple[bool, list[str]]:
    """(whether a node is labelled as a trainer node, the inference clusters by label) of the
    connected Ray cluster's live nodes; no cluster labels: one unlabelled cluster."""
    nodes = live_nodes()
    trainer = any(n.get("Labels", {}).get(ROLE_LABEL) == TRAINER_ROLE for n in nodes)
    clusters = sorted({n["Labels"][CLUSTER_LABEL] for n in nodes if CLUSTER_LABEL in n.get("Labels", {})})
    return trainer, clusters or [UNLABELLED]


def on_cluster(label: str) -> dict:
    """Actor options that place it on the nodes of inference cluster `label`."""
    return {} if label == UNLABELLED else {"label_selector": {CLUSTER_LABEL: label}}


def engine_resources(r: RolloutSection, label: str) -> dict:
    """What an engine actor in inference cluster `label` asks Ray for: a vLLM engine on a cluster
    whose nodes have GPUs takes `rollout.vllm_gpu_memory` of one (a whole GPU when 0), so Ray gives
    it a GPU of its own (CUDA_VISIBLE_DEVICES); strop's engine and CPU nodes, nothing."""
    nodes = [n for n in live_nodes() if label == UNLABELLED or n.get("Labels", {}).get(CLUSTER_LABEL) == label]
    if r.engine != "vllm" or not any(n["Resources"].get("GPU", 0) for n in nodes):
        return {}
    return {"num_gpus": r.vllm_gpu_memory or 1}


def trainer_nodes() -> tuple[list[dict], bool]:
    """The live nodes trainer ranks may use (the labelled trainer nodes, else every node), and
    whether they are labelled."""
    nodes = live_nodes()
    labelled = [n for n in nodes if n.get("Labels", {}).get(ROLE_LABEL) == TRAINER_ROLE]
    return (labelled, True) if labelled else (nodes, False)


def trainer_device(section: TrainerSection, nodes: list[dict], ranks: int) -> str:
    """The trainer ranks' device kind on Ray: "cuda" when `trainer.device` asks for it or `auto`
    finds one GPU per rank on the trainer `nodes`, else "cpu"; UserError for cuda without enough
    GPUs there."""
    gpus = sum(n["Resources"].get("GPU", 0) for n in nodes)
    if section.device == "cpu":
        return "cpu"
    if gpus >= ranks:
        return "cuda"
    if section.device == "cuda":
        raise UserError(
            f"config key 'trainer.device' is 'cuda', but the Ray cluster's trainer nodes have {gpus:g} GPUs "
            f"for trainer.parallel.fsdp = {ranks} ranks (one GPU a rank)"
        )
    return "cpu"


def trainer_placement(section: TrainerSection, ranks: int):
    """Reserve the trainer's ranks on the trainer nodes: a placement group of `ranks` bundles (a
    GPU each when the ranks run on CUDA), packed onto as few nodes as hold them. Returns the
    placement group and the device kind; UserError when they cannot all be placed."""
    from ray.util.placement_group import placement_group, remove_placement_group

    nodes, labelled = trainer_nodes()
    kind = trainer_device(section, nodes, ranks)
    bundle = {"CPU": BUNDLE_CPU, **({"GPU": 1} if kind == "cuda" else {})}
    selector = [{ROLE_LABEL: TRAINER_ROLE}] * ranks if labelled else None
    pg = placement_group([bundle] * ranks, strategy="PACK", bundle_label_selector=selector)
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(pg)
        where = "the nodes labelled strop-role=trainer" if labelled else "the cluster's nodes"
        raise UserError(
            f"config key 'trainer.parallel.fsdp': {ranks} trainer ranks ({bundle}) could not be placed on {where} "
            f"in {PLACEMENT_TIMEOUT_S:.0f} s"
        )
    return pg, kind
