"""The OpenAI-compatible `/v1/completions` client against a local stand-in server: token ids,
logprobs, versions and routing come through exactly, and HTTP failures end the episode as
"policy_error"."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from strop.engine.endpoint import EndpointClient, parse_completion
from strop.env.demonstrators.scripted import ScriptedClient
from strop.env.harness.loop import Harness
from strop.env.sandbox.backend import open_sandbox
from strop.policy_api import SamplingParams

TURNS = [
    '<tool_call>{"name": "list_dir", "arguments": {}}</tool_call>',
    'Done.<tool_call>{"name": "submit", "arguments": {}}</tool_call>',
]


@pytest.fixture
def server(tiny_tokenizer):
    """A stand-in /v1/completions server playing TURNS (or the turns in `script[0]`, replaceable)."""
    script = [ScriptedClient(TURNS, tiny_tokenizer)]
    requests = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self._reply({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

        def _reply(self, payload: dict):
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append(body)
            if self.path != "/v1/completions" or body["max_tokens"] < 1:
                self.send_error(400, "bad request")
                return
            gen = script[0].generate(body["prompt"], SamplingParams(body["max_tokens"]))
            n, p = len(gen.token_ids), len(body["prompt"])
            # as strop's server: routing for every position read (prompt and output but the last);
            # here position k "routes" to experts [k, k]
            routing = [[[k, k]] for k in range(p + n - 1)]
            choice = {
                "text": gen.text,
                "finish_reason": "stop",
                "token_ids": gen.token_ids,
                "logprobs": {"token_logprobs": [-0.5] * n},
                "policy_versions": [7] * n,
                "routed_experts": routing,
            }
            self._reply({"choices": [choice]})

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", requests, script
    httpd.shutdown()
    httpd.server_close()


def test_endpoint_episode_keeps_engine_token_data(tiny_tokenizer, server, tmp_path):
    url, requests, _ = server
    (tmp_path / "a.py").write_text("x = 1\n")
    sandbox = open_sandbox(tmp_path)
    try:
        episode = Harness(tiny_tokenizer).run(EndpointClient(url), sandbox, "Look around.")
    finally:
        sandbox.close()
    assert episode.stop_reason == "submitted", episode.detail
    seg = episode.segments[0]
    gen = [i for i, m in enumerate(seg.loss_mask) if m]
    assert {seg.behavior_logprobs[i] for i in gen} == {-0.5} and {seg.versions[i] for i in gen} == {7}
    assert all(seg.routing[i] == [[i - 1, i - 1]] for i in gen)  # the position that sampled token i
    assert requests[1]["prompt"] == seg.input_ids[: len(requests[1]["prompt"])]  # the prompt is the window so far
    assert requests[0]["stop_token_ids"] and requests[0]["logprobs"] == 0 and requests[0]["model"] == "tiny"


def test_endpoint_failure_is_a_policy_error(tiny_tokenizer, server, tmp_path):
    url, _, _ = server
    sandbox = open_sandbox(tmp_path)
    try:
        episode = Harness(tiny_tokenizer).run(EndpointClient(url + "/wrong"), sandbox, "Hi.")
        unreachable = Harness(tiny_tokenizer).run(EndpointClient("http://127.0.0.1:9", timeout_s=2), sandbox, "Hi.")
    finally:
        sandbox.close()
    assert episode.stop_reason == "policy_error" and "HTTP 400" in episode.detail
    assert unreachable.stop_reason == "policy_error"


def test_parse_completion_reads_vllm_token_strings():
    reply = {
        "choices": [
            {
                "text": "ab",
                "finish_reason": "length",
                "logprobs": {"tokens": ["token_id:5", "token_id:9"], "token_logprobs": [-1.0, -2.0]},
            }
        ]
    }
    gen = parse_completion(reply, prompt_len=3)
    assert gen.token_ids == [5, 9] and gen.logprobs == [-1.0, -2.0] and gen.versions == [0, 0]
    assert gen.finish_reason == "length" and gen.routing is None


def test_a_reply_without_token_ids_says_so():
    """A plain OpenAI server answers text (and string tokens, if any): strop cannot go on token in,
    token out, and says why instead of "policy returned 0 tokens"."""
    plain = {"text": "ab", "finish_reason": "stop", "logprobs": None}
    for choice in (plain, {**plain, "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0]}}):
        with pytest.raises(RuntimeError, match="reply carries no token ids .* a plain OpenAI API does not"):
            parse_completion({"choices": [choice]}, prompt_len=3)


def test_strop_agent_prints_the_diff_and_applies_only_when_asked(tiny_tokenizer, server, tmp_path, capsys):
    from strop.cli import main

    url, _, script = server
    tiny_tokenizer.save_pretrained(tmp_path / "tok")
    world = tmp_path / "repo"
    world.mkdir()
    (world / "mod.py").write_text("def add(a, b):\n    return a - b\n")
    edit = (
        '<tool_call>{"name": "edit_file", "arguments": {"path": "mod.py", "old": "a - b", "new": "a + b"}}</tool_call>'
    )
    argv = ["agent", "--repo", str(world), "--endpoint", url, "--tokenizer", str(tmp_path / "tok"), "Fix add."]
    script[0] = ScriptedClient([edit, TURNS[1]], tiny_tokenizer)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "stopped: submitted after 2 turns" in out and "-    return a - b\n+    return a + b" in out
    assert "not applied" in out and "a - b" in (world / "mod.py").read_text()
    script[0] = ScriptedClient([edit, TURNS[1]], tiny_tokenizer)
    assert main(argv + ["--apply"]) == 0
    assert (world / "mod.py").read_text() == "def add(a, b):\n    return a + b\n"
    assert main(["agent", "--repo", str(world), "--endpoint", url, "x"]) == 2  # no tokenizer: a user error


def test_strop_agent_samples_anew_each_run_unless_given_a_seed(tiny_tokenizer, server, tmp_path, capsys):
    """`--temperature 1` used to give the same episode every time; `--seed` makes one repeatable."""
    from strop.cli import main

    url, requests, script = server
    tiny_tokenizer.save_pretrained(tmp_path / "tok")
    argv = ["agent", "--repo", str(tmp_path), "--endpoint", url, "--tokenizer", str(tmp_path / "tok"), "Look."]
    seeds = []
    for extra in ([], [], ["--seed", "7"], ["--seed", "7"]):
        script[0] = ScriptedClient(TURNS, tiny_tokenizer)
        requests.clear()
        assert main([*argv, "--temperature", "1", *extra]) == 0
        seeds.append([r["seed"] for r in requests])
        assert f"(seed {seeds[-1][0]})" in capsys.readouterr().out
    assert seeds[0] != seeds[1] and seeds[2] == seeds[3] == [7, 8]  # one seed per turn, from the episode's
