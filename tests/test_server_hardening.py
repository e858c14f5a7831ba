"""The server under hostile or careless clients: CPU work off the event loop, bounded request size,
impossible settings refused at start-up, generation cancelled when the client goes away, a clean
exit on SIGTERM with requests in flight."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from strop.cli import main
from strop.engine.engine import Engine
from strop.model.policy import build_model, save_model
from strop.policy_api import SamplingParams
from tests.conftest import served_tiny_moe, tiny_model_section


@pytest.fixture
def slow_server(tiny_tokenizer, monkeypatch):
    """A served engine whose every step takes at least 20 ms, so a long generation stays in flight
    for seconds (the tiny model alone finishes hundreds of tokens in well under a second)."""
    with served_tiny_moe(tiny_tokenizer, max_batch=4, max_len=512) as (url, engine):
        real_step = engine.step

        def step():  # the loop thread looks it up on the instance at every iteration
            busy = real_step()
            if busy:
                time.sleep(0.02)
            return busy

        monkeypatch.setattr(engine, "step", step)
        yield url, engine


def idle_after(engine: Engine, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not engine._running and not engine._waiting:
            return True
        time.sleep(0.02)
    return False


def test_a_closed_stream_stops_generating(slow_server):
    url, engine = slow_server
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 400, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert next(r.iter_lines()).startswith("data: ")  # generation is under way
    assert idle_after(engine), "the engine kept generating for a closed stream"
    before = engine.tokens_generated
    time.sleep(0.3)
    assert engine.tokens_generated == before < 400


def test_a_client_that_hangs_up_stops_its_generation(slow_server):
    url, engine = slow_server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x = 1", "max_tokens": 400}, timeout=0.5)
    assert idle_after(engine), "the engine kept generating for a client that hung up"
    assert engine.tokens_generated < 400


def test_oversized_bodies_and_prompts_are_refused_before_parsing(slow_server):
    url, engine = slow_server
    huge = json.dumps({"model": "tiny", "prompt": "a" * (5 << 20)})
    r = httpx.post(url + "/v1/completions", content=huge, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(6):
            yield b"a" * (1 << 20)

    r = httpx.post(url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413
    long = "a" * (engine.max_len * 200)  # under the body limit, more characters than the context can hold
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": long}]},
        timeout=30,
    )
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_tokenizing_runs_off_the_event_loop(slow_server, monkeypatch):
    """While one request's prompt is being tokenized, the server still answers others."""
    url, engine = slow_server
    entered, release = threading.Event(), threading.Event()
    real_encode = engine.tokenizer.encode

    def blocking_encode(text, *a, **k):
        if text.startswith("BLOCK"):
            entered.set()
            release.wait(10)
        return real_encode(text, *a, **k)

    monkeypatch.setattr(engine.tokenizer, "encode", blocking_encode)
    result = {}
    t = threading.Thread(
        target=lambda: result.update(
            r=httpx.post(
                url + "/v1/completions", json={"model": "tiny", "prompt": "BLOCK me", "max_tokens": 2}, timeout=30
            )
        )
    )
    t.start()
    try:
        assert entered.wait(10)
        assert httpx.get(url + "/health", timeout=2).status_code == 200  # the event loop is free
    finally:
        release.set()
        t.join(30)
    assert result["r"].status_code == 200


def test_impossible_engine_settings_are_refused(tiny_moe, tiny_tokenizer):
    for kwargs in ({"max_batch": 0}, {"max_batch": -1}, {"max_len": 1}, {"max_len": 10**6}):
        with pytest.raises(ValueError):
            Engine(tiny_moe, tiny_tokenizer, **kwargs)


def test_cancel_and_stop_finish_every_request(tiny_moe, tiny_tokenizer):
    engine = Engine(tiny_moe, tiny_tokenizer, max_batch=1, max_len=256)
    ids = tiny_tokenizer.encode("import os")
    running = engine.submit(ids, SamplingParams(max_tokens=200, stop_token_ids=[]))
    waiting = engine.submit(ids, SamplingParams(max_tokens=200, stop_token_ids=[]))
    engine.step()
    engine.cancel(waiting)  # never admitted: finished without a slot
    engine.step()
    assert waiting.done.is_set() and waiting.result.finish_reason == "abort" and waiting.result.token_ids == []
    engine.cancel(running)
    engine.step()
    assert running.result.finish_reason == "abort" and 0 < len(running.result.token_ids) < 200
    late = engine.submit(ids, SamplingParams(max_tokens=200, stop_token_ids=[]))
    engine.step()  # the slot came back: the next request is admitted
    engine.start()
    engine.stop()
    assert late.done.is_set() and late.result.finish_reason == "abort"


def test_serve_refuses_a_busy_port_and_exits_on_sigterm_mid_request(tiny_tokenizer, tmp_path, capsys):
    model = build_model(tiny_model_section("qwen3_moe"), tiny_tokenizer, seed=0).eval()
    save_model(model, tiny_tokenizer, tmp_path / "m")
    args = ["serve", "--checkpoint", str(tmp_path / "m"), "--threads", "1"]
    with socket.create_server(("127.0.0.1", 0)) as busy:
        assert main(args + ["--port", str(busy.getsockname()[1])]) == 2
    assert "cannot listen" in capsys.readouterr().err
    assert main(args + ["--port", "0", "--max-len", "100000"]) == 2
    assert "max_len" in capsys.readouterr().err
    cmd = [sys.executable, "-m", "strop.cli", *args]
    proc = subprocess.Popen(cmd + ["--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert " on http://" in line, line
        url = line.split(" on ")[1].split()[0]
        stream = httpx.Client(timeout=30).stream(
            "POST", url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 500, "stream": True}
        )
        r = stream.__enter__()
        assert next(r.iter_lines()).startswith("data: ")
        t0 = time.time()
        os.kill(proc.pid, signal.SIGTERM)
        assert (
            proc.wait(timeout=30) == 128 + signal.SIGTERM
        )  # uvicorn re-raises it once shut down: the CLI exits as for any SIGTERM
        assert time.time() - t0 < 20
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
