"""strop on a real multi-node Ray cluster started on this machine (`strop.runtime.ray.local_cluster`):
the trainer on the trainer node, a relay and engines on each inference cluster's node, weights as
deltas through the relays. The fast test runs 2 nodes for a few steps; the slow one 3 nodes (one
trainer cluster, two inference clusters) over shaped links, with an engine joining and another
killed mid-run."""

import json

import pytest

from strop.config import load_config
from strop.runtime import record_trained

pytestmark = pytest.mark.xdist_group("ray")  # one Ray instance at a time on this machine

# Zero reward, zero gradient: weight decay makes every version's delta real (see test_weight_transport).
BASE = [
    "rl.group_size=2",
    "rl.batch_groups=1",
    "rl.lr=1e-3",
    "rl.weight_decay=0.1",
    "rl.skip_zero_advantage=false",
    "rollout.workers=2",
    "rollout.engine_batch=4",
    "rollout.train_tasks=6",
    "rollout.max_turns=1",
    "rollout.max_turn_tokens=16",
    "rollout.max_context=1536",
    "rollout.ckpt_every=100",
    "rollout.retries=3",
]


def _engines_match_trainer(rt) -> bool:
    import ray

    want = rt.trainer.weights_crc32()  # the gathered bf16 snapshot, from every rank
    return all(ray.get(e.weights_crc32.remote()) == want for e in rt.engines.values())


def test_two_nodes_trainer_and_one_inference_cluster(tmp_path, tiny_policy_dir):
    import ray

    from strop.rl.orchestrator import Orchestrator, router_replay
    from strop.runtime.ray.actors import start_ray
    from strop.runtime.ray.local_cluster import local_cluster
    from strop.runtime.rl_run import train_tasks
    from strop.sync.store import Store

    cfg = load_config(None, BASE + ["rl.steps=3", "rollout.engines=1"])
    tasks = {t.id: t for t in train_tasks(cfg)}
    with local_cluster(["a"]) as address:
        nodes = {n["Labels"].get("strop-cluster", "trainer"): n["NodeID"] for n in ray.nodes()}
        rt = start_ray(
            cfg,
            str(tiny_policy_dir),
            tasks,
            router_replay,
            address=address,
            rollout_actors=1,
            store_url=str(tmp_path / "weights"),
        )
        try:
            matched = []
            orch = Orchestrator(
                cfg,
                rt,
                list(tasks),
                "sync",
                tmp_path / "rl",
                log=lambda row: matched.append(_engines_match_trainer(rt)),
            )
            result = orch.run()
            stats = rt.sync_stats()
            (engine,) = rt.engines.values()
            engine_node = ray.get(engine.info.remote())["node"]
            relay_node = ray.get(rt.relays["a"].stats.remote())["node"]
        finally:
            rt.close()
    assert result["steps"] == 3 and result.get("lost", 0) == 0 and matched == [True] * 3
    assert rt.clusters == ["a"] and engine_node == relay_node == nodes["a"]
    store = Store(str(tmp_path / "weights"))
    assert stats["sent_by_version"] == {v: [1, store.manifest(v).nbytes] for v in (1, 2, 3)}  # once, to the one relay


@pytest.mark.slow
def test_three_nodes_two_clusters_engines_join_and_leave_over_shaped_links(tmp_path, tiny_policy_dir):
    import ray

    from strop.rl.orchestrator import Orchestrator, router_replay
    from strop.runtime.ray.actors import start_ray
    from strop.runtime.ray.local_cluster import local_cluster
    from strop.runtime.rl_run import train_tasks

    cfg = load_config(
        None,
        BASE
        + [
            "rl.steps=6",
            "rl.max_staleness=1",
            "rollout.engines=4",
            "rollout.workers=4",
            "sync.wan_mb_s=2",
            "sync.lan_mb_s=20",
            "sync.keep_deltas=2",
        ],
    )
    tasks = {t.id: t for t in train_tasks(cfg)}
    with local_cluster(["a", "b"]) as address:
        nodes = {n["Labels"].get("strop-cluster"): n["NodeID"] for n in ray.nodes()}
        rt = start_ray(
            cfg, str(tiny_policy_dir), tasks, router_replay, address=address, store_url=str(tmp_path / "weights")
        )
        trained = record_trained(rt)
        events: dict = {}

        def churn(row):
            if row["step"] == 2:  # harvested capacity: a new engine in cluster b, mid-run
                events["joined"] = rt.add_engine("b")
            if row["step"] == 3:  # an engine of cluster a dies with work in flight
                events["killed"] = next(n for n, c in sorted(rt.engine_cluster.items()) if c == "a")
                ray.kill(rt.engines[events["killed"]])

        try:
            orch = Orchestrator(cfg, rt, list(tasks), "async", tmp_path / "rl", log=churn)
            result = orch.run()
            rt.wait_synced()
            matched = _engines_match_trainer(rt)
            stats = rt.sync_stats()
            infos = {name: ray.get(e.info.remote()) for name, e in rt.engines.items()}
        finally:
            rt.close()
    assert result["steps"] == 6 and result.get("lost", 0) == 0 and matched
    assert len(trained) == len(set(trained)) == 6 * 2  # every trained group whole, nothing twice
    assert events["killed"] not in infos and events["joined"] in infos
    assert all(info["node"] == nodes[info["label"]] for info in infos.values())  # placed by cluster label
    # each version left the trainer once per inference cluster, however many engines each had
    assert all(n == 2 for n, _ in stats["sent_by_version"].values()) and sorted(stats["sent_by_version"]) == list(
        range(1, 7)
    )
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["bytes_synced"] >= sum(b for _, b in stats["sent_by_version"].values())
    assert all(r["staleness_max"] <= 1 for r in rows)
