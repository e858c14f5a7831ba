"""The online cycle on a tiny model behind a real HTTP server and a real SQLite completion log:
simulated users rate served replies, one cycle trains on the ratings and promotes a candidate
that passes the gates, a deliberately harmful update is refused by a gate, and
`strop online rollback` restores an earlier version's weights bit for bit."""

import contextlib
import dataclasses
import json
import zlib

import pytest
import torch

from strop.cli import main
from strop.commands.agent import report_edits
from strop.config import RLSection
from strop.engine.endpoint import EndpointClient
from strop.engine.engine import Engine
from strop.engine.server import serve_in_thread
from strop.online.app import create_serving_app
from strop.online.auth import KeyFile
from strop.online.cycle import CycleSettings, initialize, run_cycle, served
from strop.online.gates import GateSettings, compare, regressed
from strop.online.monitors import classify
from strop.online.population import drive, prefers
from strop.online.probes import task_request
from strop.online.rewards import RewardMap
from strop.online.sim_policy import reply
from strop.online.simulate import prepare
from strop.online.store import Store
from strop.online.versions import Versions

ROLES = {"edit_file": "edit"}  # the offered tools' roles, as strop.online.monitors.offered_roles gives them


def test_rewards_are_tab_style_and_configurable():
    r = RewardMap()
    assert (r("accept", "accept"), r("accept", "reject"), r("thumbs", "up"), r("edit", "reverted")) == (
        0.75,
        -0.25,
        0.75,
        -0.25,
    )
    assert RewardMap.parse("accept.reject=-1, thumbs.up=0.5")("accept", "reject") == -1.0
    for bad in ("accept.maybe=1", "accept.reject", "accept.reject=x"):
        with pytest.raises(ValueError, match="reward"):
            RewardMap.parse(bad)


def test_monitors_and_hidden_preference_read_the_replies():
    request = task_request("parse", 0)
    tools = {"edit_file": "edit"}  # the offered tools' roles (monitors.offered_roles)
    scoped, spill, question = (classify(reply(request, b), tools) for b in ("scoped", "spill", "question"))
    assert scoped.edit and not scoped.question and scoped.edited_paths == ("src/parse.py",)
    assert spill.edited_paths == ("src/parse.py", "CHANGELOG.md") and question.question and not question.edit
    assert classify('<tool_call>{"name": "run", "arguments": {}}</tool_call><|im_end|>', tools).invalid_tool_call
    assert classify("<tool_call>{not json</tool_call>", tools).invalid_tool_call
    call = lambda path: {"tool_calls": [{"function": {"name": "edit_file", "arguments": f'{{"path": "{path}"}}'}}]}  # noqa: E731
    assert prefers(request, call("src/parse.py")) and not prefers(request, call("CHANGELOG.md"))
    assert not prefers(request, {"content": "Which function?"})
    assert regressed(5, 100, 30, 100, higher_is_bad=True) and not regressed(5, 100, 8, 100, higher_is_bad=True)
    assert not regressed(0, 10, 0, 10, higher_is_bad=False)
    figures = {"monitors": {"question_rate": {"rate": 0.1, "n": 100, "alert": False}}, "suites": {}}
    worse = {"monitors": {"question_rate": {"rate": 0.4, "n": 100, "alert": True}}, "suites": {}}
    assert compare(figures, worse)["question_rate"]["passed"] is False
    assert compare(figures, figures)["question_rate"]["passed"] is True
    # within the interval of the current figure, but past the alert threshold the current one is inside
    creep = {"monitors": {"question_rate": {"rate": 0.11, "n": 100, "alert": True}}, "suites": {}}
    assert compare(figures, creep)["question_rate"]["passed"] is False


@contextlib.contextmanager
def online_server(tmp_path, tokenizer):
    """The mixture policy (warm-started for 120 steps) behind the app `strop serve` runs, with keys, a SQLite
    log and the weight store holding version 0: yields (settings, store, engine, population)."""
    made = prepare(
        tmp_path, tokenizer, users=4, warm_steps=120, seed=0, log=lambda line: None
    )  # edits ~80% of the time
    keys = KeyFile.load(tmp_path / "keys.json")
    store = Store(str(tmp_path / "feedback.db"))
    engine = Engine.from_checkpoint(str(made["base"]), max_batch=16, max_len=1024, stale_prefixes=False)
    app = create_serving_app(engine, "sim", keys, store, Versions(str(tmp_path / "weights")))
    url, stop = serve_in_thread(engine, "sim", app=app)
    s = CycleSettings(
        checkpoint=str(made["base"]),
        weights=str(tmp_path / "weights"),
        engines=[url],
        admin_key=made["admin"],
        run_dir=tmp_path,
        min_rated=8,
        rl=RLSection(lr=1e-6, micro_batch=16, measure_every=0),
        gates=GateSettings(suites=(), probe_samples=1),
    )
    try:
        yield s, store, engine, made["population"]
    finally:
        stop()
        store.close()


def test_one_cycle_promotes_a_harmful_update_is_refused_and_rollback_is_bitwise(tmp_path, tiny_tokenizer, monkeypatch):
    with online_server(tmp_path, tiny_tokenizer) as (s, store, engine, users):
        assert initialize(s, store) == 0
        v0 = {n: t.clone() for n, t in engine.named_tensors().items()}
        assert run_cycle(s, store)["status"] == "waiting"  # no ratings yet
        drive(s.engines[0], "sim", users, 16, "c0", seed=0, workers=4)
        report = run_cycle(s, store)
        assert report["status"] == "promoted" and report["rated"] == 16 and report["candidate"] == 1, report
        assert engine.version == 1 and served(store).version == 1
        assert all(g["passed"] for g in report["gates"].values())
        assert set(report["traffic_monitors"]) == {"invalid_tool_call_rate", "edit_rate", "question_rate"}
        assert "sycophancy_rate" in report["candidate_figures"]["monitors"]
        assert run_cycle(s, store)["status"] == "waiting"  # those ratings are consumed

        drive(s.engines[0], "sim", users, 16, "c1", seed=1, workers=4)
        harmful = dataclasses.replace(s, rl=RLSection(lr=0.5, micro_batch=16, measure_every=0))
        # a deliberately harmful update: rewards by coin flip at a huge learning rate (the mixture policy
        # warm-started this briefly asks too rarely for `asks_instead_of_editing` to have a signal)
        refused = run_cycle(harmful, store, reward_of=lambda rc: (-1.0, 1.0)[zlib.crc32(rc.completion.id.encode()) % 2])
        assert refused["status"] == "refused" and refused["failed_gates"], json.dumps(
            [refused["train"], refused["gates"]]
        )
        assert engine.version == 1 and served(store).version == 1  # nothing served changed

        monkeypatch.setenv("STROP_API_KEY", s.admin_key)
        rollback = ["online", "rollback", "--to", "0", "--store", str(tmp_path / "feedback.db")]
        rollback += ["--weights-store", s.weights, "--engine", s.engines[0], "--checkpoint", s.checkpoint]
        assert main([*rollback, "--run-dir", str(tmp_path)]) == 0
        assert engine.version == 0 and served(store).version == 0
        assert all(torch.equal(engine.named_tensors()[n], t) for n, t in v0.items())  # bit for bit
        assert [d.kind for d in store.deployments()] == ["initial", "promoted", "refused", "rollback"]
        assert main(rollback) == 2


def test_online_command_refuses_bad_input(capsys, monkeypatch, tmp_path):
    assert main(["online", "--once"]) == 2
    assert "needs --checkpoint" in capsys.readouterr().err
    monkeypatch.delenv("STROP_API_KEY", raising=False)
    assert (
        main(
            [
                "online",
                "--once",
                "--checkpoint",
                "x",
                "--store",
                "x.db",
                "--weights-store",
                "w",
                "--engine",
                "http://127.0.0.1:1",
            ]
        )
        == 2
    )
    assert "STROP_API_KEY" in capsys.readouterr().err
    monkeypatch.setenv("STROP_API_KEY", "k")
    assert (
        main(
            [
                "online",
                "--interval",
                "soon",
                "--checkpoint",
                "x",
                "--store",
                "x.db",
                "--weights-store",
                "w",
                "--engine",
                "http://127.0.0.1:1",
            ]
        )
        == 2
    )
    assert (
        main(
            [
                "online",
                "--once",
                "--rewards",
                "accept.maybe=1",
                "--checkpoint",
                "x",
                "--store",
                "x.db",
                "--weights-store",
                "w",
                "--engine",
                "http://127.0.0.1:1",
            ]
        )
        == 2
    )
    capsys.readouterr()
    # a run config whose chat template is not a file, a --simulate base that is not a model: one line each
    config = tmp_path / "bad.toml"
    config.write_text('[harness]\nchat_template = "no/such.jinja"\n')
    assert main(["online", "--simulate", "1", "--config", str(config), "--run-dir", str(tmp_path / "r")]) == 2
    assert "chat_template" in capsys.readouterr().err
    assert main(["online", "--simulate", "1", "--checkpoint", str(tmp_path), "--run-dir", str(tmp_path / "r")]) == 2
    assert "not a model directory" in capsys.readouterr().err


@pytest.mark.slow
def test_simulated_users_approval_rises_outside_its_interval(tmp_path):
    """The acceptance run, `strop online --simulate 4 --json F` at its defaults (384 requests a
    cycle): a real `strop serve` process, real HTTP, a real SQLite log (~4 min here; its figures are
    in docs/guides/online.md: 0.469 [0.419, 0.519] -> 0.661 [0.613, 0.707], one candidate refused by
    the invalid-tool-call gate). A refused candidate is the gates at work; the served version's
    approval must still rise outside its interval."""
    out = tmp_path / "sim.json"
    assert main(["online", "--simulate", "4", "--json", str(out), "--run-dir", str(tmp_path / "run")]) == 0
    report = json.loads(out.read_text())
    assert len(report["approval"]) == len(report["approval_ci95"]) == 5 and len(report["gates"]) == 4
    assert report["rises_outside_ci95"], report["approval_rounds"]
    assert report["gates"][0]["status"] == "promoted"
    assert report["blocked_harmful"] is True and report["rollback_bitwise"] is True


def test_agent_sessions_report_their_edits_kept_or_reverted(tmp_path, tiny_tokenizer):
    """`strop agent` against a keyed server rates each served completion that edited a file."""
    from strop.data.chat import render
    from strop.online.probes import EDIT_TOOL
    from strop.policy_api import SamplingParams

    with online_server(tmp_path, tiny_tokenizer) as (s, store, engine, users):
        client = EndpointClient(
            s.engines[0], model="sim", headers={"Authorization": f"Bearer {users[0].key}"}, served=[]
        )
        request = task_request("parse", 0)
        prompt = tiny_tokenizer.encode(render(request.messages, EDIT_TOOL, add_generation_prompt=True))
        for seed in (1, 2):
            client.generate(prompt, SamplingParams(max_tokens=96, temperature=1.0, seed=seed))
        (edited, _), (asked, _) = client.served
        # what the two turns said, fixed here so that one edits and one does not, whatever was sampled
        client.served = [(edited, reply(request, "scoped")), (asked, reply(request, "question"))]
        report_edits(client, kept=False, roles=ROLES)
        report_edits(client, kept=False, roles=ROLES)  # a retried session: the same events, stored once
        rows = store.feedback()
        assert [(r.completion_id, r.kind, r.value, r.key_name) for r in rows] == [(edited, "edit", "reverted", "user0")]
        report_edits(EndpointClient(s.engines[0], model="sim"), kept=True, roles=ROLES)  # no key: nothing is sent
        assert store.count("feedback") == 1
