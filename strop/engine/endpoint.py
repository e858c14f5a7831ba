"""`EndpointClient`: the one HTTP client, a `PolicyClient` over an OpenAI-compatible server given
token ids: strop's engine server, vLLM (`strop.engine.vllm_server`) or any compatible endpoint.
It also reads the served weights version and asks for a weight update where the server offers
strop's `/weights/*` endpoints.

The request sends the prompt as token ids and asks for per-token logprobs, the sampled ids
(`return_token_ids`; vLLM's older `logprobs.tokens` form "token_id:N" is read too) and routed
experts (`return_routed_experts`). Beyond the OpenAI fields it reads what strop's engine server
and vLLM add: `choices[0].token_ids`, `choices[0].policy_versions` (per token) and
`choices[0].routed_experts` ([positions read, MoE layers, top_k], every position of prompt and
output but the last, of which the generated tokens' rows are kept: nested lists from strop's
server, base64 `.npy` bytes from vLLM, which returns them whenever it was started with
`--enable-return-routed-experts`). With `model` None the first
model `/v1/models` lists is used. Stateless between requests (urllib), so threads share one.
"""

import base64
import io
import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from strop.policy_api import Generation, SamplingParams, generated_routing

# strop drives a policy token in, token out: a reply of text alone (OpenAI's own API, most proxies)
# cannot be trained on, nor continued without re-tokenizing what the policy said
NO_TOKEN_IDS = (
    "the endpoint's reply carries no token ids (choices[0].token_ids, or logprobs.tokens as 'token_id:N'): "
    "strop needs a server that returns the sampled ids, such as strop serve or vLLM; a plain OpenAI API does not"
)


class EndpointError(RuntimeError):
    """The server answered with an HTTP error: `status`, and the message of its error body."""

    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status, self.message = status, message


@dataclass
class EndpointClient:
    url: str  # the server root, e.g. http://127.0.0.1:8000
    model: str | None = None
    timeout_s: float = 600.0
    headers: dict[str, str] = field(default_factory=dict)
    # (completion id, text) of each generate, where a caller asks for them with a list (None: kept
    # nowhere, as in an RL run, where they would pile up)
    served: list[tuple[str, str]] | None = None

    def _request(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url.rstrip("/").removesuffix("/v1") + path,
            data=data,
            headers={"Content-Type": "application/json", **self.headers},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.load(response)
        except urllib.error.HTTPError as e:
            raise EndpointError(self.url, e.code, _error_message(e.read())) from None

    def connect(self) -> str:
        """Check that the server answers `/v1/models` and settle the model (the first listed when
        `model` is None); raises ConnectionError saying why not (unreachable, not such a server)."""
        try:
            models = [m["id"] for m in self._request("/v1/models")["data"]]
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:  # URLError is an OSError
            raise ConnectionError(
                f"{self.url} is not an OpenAI-compatible server that answers: {getattr(e, 'reason', None) or e}"
            ) from None
        if not models or (self.model is not None and self.model not in models):
            raise ConnectionError(f"{self.url} serves {models}, not {self.model!r}")
        self.model = self.model or models[0]
        return self.model

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if self.model is None:
            self.connect()
        body = {
            "model": self.model,
            "prompt": list(prompt_ids),
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "logprobs": 0,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "return_routed_experts": True,
        }
        if params.stop_token_ids is not None:  # only these end it (vLLM would also stop at its end token)
            body["stop_token_ids"], body["ignore_eos"] = list(params.stop_token_ids), True
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = params.seed
        reply = self._request("/v1/completions", body)
        generation = parse_completion(reply, len(prompt_ids))
        if self.served is not None:
            self.served.append((str(reply.get("id", "")), generation.text))
        return generation

    def feedback(self, completion_id: str, kind: str, value: str) -> dict:
        """Rate a completion this server served (`POST /v1/feedback`; the headers carry a key with the
        feedback scope). The event id is derived from the rating, so a retry is counted once."""
        body = {"event_id": f"{completion_id}:{kind}", "completion_id": completion_id, "kind": kind, "value": value}
        return self._request("/v1/feedback", body)

    def weights_version(self) -> int:
        """The version the server serves (strop's `/weights/version`)."""
        return int(self._request("/weights/version")["version"])

    def load_version(self, version: int) -> dict:
        """Have a strop server load `version` from the run's weight store (`strop serve
        --weights-store`; this client's headers must carry an admin key): {"version", "pause_s"}."""
        return self._request("/weights/update", {"version": version})

    def update_weights(self, path: str, version: int | None = None) -> dict:
        """Make the server load weights from a safetensors file or model directory it can read;
        returns {"version", "pause_s"}. A refused update raises EndpointError (400)."""
        return self._request("/weights/update", {"path": path, "version": version})


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else its first bytes."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300].decode(errors="replace")


def parse_completion(reply: dict, prompt_len: int) -> Generation:
    """A `/v1/completions` response (one choice) to a Generation."""
    choice = reply["choices"][0]
    lp = choice.get("logprobs") or {}
    ids = choice.get("token_ids")
    if ids is None:
        tokens = lp.get("tokens") or []
        if not tokens or not all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            raise RuntimeError(NO_TOKEN_IDS)
        ids = [int(t.removeprefix("token_id:")) for t in tokens]
    logprobs = [float(x) for x in lp.get("token_logprobs") or []]
    if len(logprobs) != len(ids):
        raise RuntimeError(f"endpoint returned {len(ids)} token ids but {len(logprobs)} logprobs")
    versions = choice.get("policy_versions") or [0] * len(ids)
    routing = choice.get("routed_experts")
    if isinstance(routing, str):  # vLLM: an .npy array, base64-encoded
        import numpy as np

        routing = np.load(io.BytesIO(base64.b64decode(routing)), allow_pickle=False)
    routing = generated_routing(routing, prompt_len, len(ids))
    finish = "length" if choice.get("finish_reason") == "length" else "stop"
    return Generation(list(ids), logprobs, list(versions), choice.get("text", ""), routing, finish)
