"""The Ray runtime end to end on a tiny MoE (slow: a local Ray instance and five actor processes).
Mid-run an engine actor and a rollout worker are killed: the run goes on with the other engine
and a replacement worker, lost episodes are relaunched, none is lost or trained on twice."""

import json

import pytest

from strop.config import load_config
from strop.runtime import record_trained

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


def test_killing_an_engine_and_a_worker_mid_run(tmp_path, tiny_policy_dir):
    import ray

    from strop.rl.orchestrator import Orchestrator, router_replay
    from strop.runtime.ray.actors import start_ray
    from strop.runtime.rl_run import train_tasks

    cfg = load_config(
        None,
        [
            "rl.group_size=2",
            "rl.batch_groups=2",
            "rl.steps=4",
            "rl.max_staleness=2",
            "rollout.engines=2",
            "rollout.workers=4",
            "rollout.train_tasks=8",
            "rollout.max_turns=2",
            "rollout.max_turn_tokens=24",
            "rollout.max_context=1536",
            "rollout.retries=3",
        ],
    )
    tasks = {t.id: t for t in train_tasks(cfg)}
    rt = start_ray(cfg, str(tiny_policy_dir), tasks, router_replay)
    trained = record_trained(rt)
    killed: dict = {}

    def kill_after_first_step(row):
        if row["step"] == 1:
            killed["engine"] = sorted(rt.engines)[0]
            ray.kill(rt.engines[killed["engine"]])
            ray.kill(rt.workers[0])

    try:
        orch = Orchestrator(cfg, rt, list(tasks), "async", tmp_path, log=kill_after_first_step)
        result = orch.run()
        live_engines = sorted(rt.engines)
    finally:
        rt.close()
        ray.shutdown()
    assert result["steps"] == 4 and killed["engine"] not in live_engines and len(live_engines) == 1
    assert result.get("relaunched", 0) > 0 and result.get("lost", 0) == 0
    assert len(trained) == len(set(trained)) == 4 * 2 * 2  # every trained group whole, nothing twice
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["staleness_max"] <= 2 for r in rows) and rows[-1]["bytes_synced"] > 0
