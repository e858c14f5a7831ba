"""The OpenAI-compatible server, driven by the official `openai` client and by strop's `EndpointClient`."""

import json
import threading

import httpx
import pytest

from strop.engine.endpoint import EndpointClient
from strop.engine.policy_client import EnginePolicy
from strop.policy_api import SamplingParams

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run a command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def server(tiny_tokenizer):
    from tests.conftest import served_tiny_moe

    with served_tiny_moe(tiny_tokenizer, max_batch=8, max_len=256) as s:
        yield s


def test_openai_client_models_complete_chat_stream(server):
    import openai

    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == ["tiny"]
    c = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=5, logprobs=1, seed=1)
    assert len(c.choices[0].logprobs.token_logprobs) == 5 and c.usage.completion_tokens == 5
    assert len(c.choices[0].model_extra["token_ids"]) == 5
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "list files"}],
        tools=TOOLS,
        max_tokens=6,
        logprobs=True,
    )
    ch = chat.choices[0]
    assert ch.message.role == "assistant" and ch.finish_reason in ("stop", "length", "tool_calls")
    assert len(ch.logprobs.content) == len(ch.model_extra["token_ids"]) > 0
    pieces = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True, seed=2
        )
    )
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")
    streamed = "".join(p.choices[0].delta.content or "" for p in pieces)
    again = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, seed=2
    )
    assert streamed.strip() == (again.choices[0].message.content or "")  # same seed: the same text, streamed
    text = "".join(
        p.choices[0].text for p in client.completions.create(model="tiny", prompt="x =", max_tokens=4, stream=True)
    )
    assert isinstance(text, str)


def test_tool_calls_are_parsed(server, monkeypatch):
    url, engine = server
    call = '<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}}</tool_call><|im_end|>'
    forced = engine.tokenizer.encode(call)
    real_sample = engine._sample

    def scripted(logits, batch):  # make the model "say" a tool call, with real logprobs of those tokens
        toks, lps = real_sample(logits, batch)
        return [forced[min(len(r.token_ids), len(forced) - 1)] for r in batch], lps

    monkeypatch.setattr(engine, "_sample", scripted)
    reply = httpx.post(
        url + "/v1/chat/completions",
        timeout=60,
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "list files"}],
            "tools": TOOLS,
            "max_tokens": 40,
        },
    ).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["function"]["name"] == "bash"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"cmd": "ls"}


def test_endpoint_client_routing_versions_and_weights(server, tmp_path):
    """Over HTTP the same Generation as in process (same seed: same tokens, logprobs, routing);
    weights updated through the client are served with their version."""
    from safetensors.torch import save_file

    url, engine = server
    client = EndpointClient(url)
    prompt, params = engine.tokenizer.encode("import os"), SamplingParams(max_tokens=4, seed=0, stop_token_ids=[])
    g = client.generate(prompt, params)
    assert len(g.token_ids) == len(g.logprobs) == len(g.versions) == len(g.routing) == 4
    assert all(len(layers) == 2 and all(len(top) == 2 for top in layers) for layers in g.routing)
    local = EnginePolicy(engine).generate(prompt, params)
    assert (local.token_ids, local.routing) == (g.token_ids, g.routing)
    assert local.logprobs == pytest.approx(g.logprobs, abs=1e-6)
    v = client.weights_version()
    w = {"model.norm.weight": engine.model.model.norm.weight.detach().clone()}
    save_file(w, str(tmp_path / "w.safetensors"))
    out = client.update_weights(str(tmp_path / "w.safetensors"), version=v + 5)
    assert out["version"] == v + 5 == client.weights_version() and out["pause_s"] >= 0
    assert client.generate(prompt, SamplingParams(max_tokens=2, stop_token_ids=[])).versions == [v + 5, v + 5]


def test_concurrent_requests_batched(server):
    url, engine = server
    client = EndpointClient(url)
    results = []
    params = SamplingParams(max_tokens=20, stop_token_ids=[])
    threads = [
        threading.Thread(
            target=lambda i=i: results.append(client.generate(engine.tokenizer.encode(f"x = {i}"), params))
        )
        for i in range(6)
    ]
    steps0 = engine.tokens_generated
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 6 and all(len(r.token_ids) == 20 for r in results)
    assert engine.tokens_generated - steps0 == 120
    assert engine.peak_batch >= 2  # requests from different connections shared decode steps


@pytest.mark.parametrize(
    "path,body,status",
    [
        ("/v1/completions", "{not json", 400),
        ("/v1/completions", {"model": "tiny"}, 400),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -1}, 400),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": "hot"}, 400),
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404),
        ("/v1/completions", {"model": "tiny", "prompt": [10**9]}, 400),
        ("/v1/completions", {"model": "tiny", "prompt": "x" * 5000}, 400),
        ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": {"a": 1}}]}, 400),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": "bash"},
            400,
        ),
        ("/weights/update", {"path": "/nonexistent"}, 400),
    ],
)
def test_malformed_requests_get_4xx_and_server_survives(server, path, body, status):
    url, _ = server
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(url + path, content=data, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
