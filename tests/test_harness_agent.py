"""`strop agent --checkpoint`: the harness driving a real (tiny, untrained) model through the
in-process engine. An untrained model writes noise; the episode still ends with a recorded
reason, and every generated token carries the engine's logprob, version and routing."""

import dataclasses
import json

import pytest

from strop.env.harness.loop import STOP_REASONS


@pytest.mark.slow  # ~15 s here: model build, save, load and a 1k-token prefill
def test_agent_runs_a_local_checkpoint(tiny_tokenizer, tmp_path, capsys):
    from strop.cli import main
    from strop.model.policy import build_model, save_model
    from tests.conftest import tiny_model_section

    section = dataclasses.replace(tiny_model_section("qwen3_moe"), max_positions=2048)
    save_model(build_model(section, tiny_tokenizer, seed=0), tiny_tokenizer, tmp_path / "ckpt")
    world = tmp_path / "repo"
    world.mkdir()
    (world / "a.py").write_text("x = 1\n")
    argv = [
        "agent",
        "--repo",
        str(world),
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--max-turns",
        "2",
        "--max-context",
        "1100",
        "--json",
        str(tmp_path / "ep.json"),
        "Fix a.py.",
    ]
    assert main(argv) == 0
    assert "stopped: " in capsys.readouterr().out
    episode = json.loads((tmp_path / "ep.json").read_text())
    assert episode["stop_reason"] in STOP_REASONS and episode["stop_reason"] not in ("error", "policy_error")
    seg = episode["segments"][0]
    generated = [i for i, m in enumerate(seg["loss_mask"]) if m]
    assert generated and len(seg["input_ids"]) <= 1100
    assert all(seg["behavior_logprobs"][i] <= 0 and seg["versions"][i] == 0 for i in generated)
    assert all(len(seg["routing"][i]) == section.num_layers for i in generated)  # one expert set per MoE layer
    assert (world / "a.py").read_text() == "x = 1\n"  # nothing applied without --apply


@pytest.mark.slow  # ~15 s here: a 1k-token prefill on a tiny model
def test_harness_through_strop_engine_server(tiny_tokenizer, tmp_path):
    from strop.engine.endpoint import EndpointClient
    from strop.engine.engine import Engine
    from strop.engine.server import serve_in_thread
    from strop.env.harness.loop import Harness, HarnessConfig
    from strop.env.sandbox.backend import open_sandbox
    from strop.model.policy import build_model
    from tests.conftest import tiny_model_section

    section = dataclasses.replace(tiny_model_section("qwen3_moe"), max_positions=2048)
    engine = Engine(build_model(section, tiny_tokenizer, seed=0), tiny_tokenizer, max_batch=2)
    url, stop = serve_in_thread(engine, "tiny")
    sandbox = open_sandbox(tmp_path)
    try:
        episode = Harness(tiny_tokenizer, HarnessConfig(max_turns=1, max_context=1100)).run(
            EndpointClient(url), sandbox, "Fix it."
        )
    finally:
        sandbox.close()
        stop()
    assert episode.stop_reason in STOP_REASONS and episode.stop_reason not in ("error", "policy_error"), episode.detail
    seg = episode.segments[0]
    generated = [i for i, m in enumerate(seg.loss_mask) if m]
    assert generated and all(seg.behavior_logprobs[i] <= 0 and seg.versions[i] == 0 for i in generated)
    assert all(len(seg.routing[i]) == section.num_layers for i in generated)
