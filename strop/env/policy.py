"""What the harness asks a policy for: the next assistant turn as token ids, given the token ids
of the context so far. The in-process engine client, an OpenAI-compatible HTTP endpoint
(`EndpointClient`) and the scripted oracle all implement `PolicyClient`.

Token ids in, token ids out: the harness never re-tokenizes generated text, so the tokens trained
on are exactly the tokens sampled, with the logprobs, policy versions and (for MoE) expert routing
the engine reported for them.
"""

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()  # generation ends after emitting one of these (it is returned)
    seed: int | None = None


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each sampled token under the behaviour policy
    versions: list[int]  # policy version that sampled each token (weights can change mid-turn)
    text: str  # token_ids decoded, special tokens kept
    routing: list[list[list[int]]] | None = None  # per token, per MoE layer: expert ids
    finish_reason: str = "stop"  # "stop" (a stop token ended it) or "length" (max_tokens did)


class PolicyClient(Protocol):
    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...


@dataclass
class EndpointClient:
    """A `PolicyClient` over an OpenAI-compatible `/v1/completions` endpoint given token ids.

    The request sends the prompt as token ids and asks for per-token logprobs, the sampled ids
    (`return_token_ids`; vLLM's older `logprobs.tokens` form "token_id:N" is read too) and routed
    experts (`return_routed_experts`). Beyond the OpenAI fields it reads what strop's engine server
    and vLLM add: `choices[0].token_ids`, `choices[0].policy_versions` (per token) and
    `choices[0].routed_experts` ([positions read, MoE layers, top_k], every position of prompt and
    output but the last, of which the generated tokens' rows are kept). With `model` None the
    first model `/v1/models` lists is used.
    """

    url: str  # the server root, e.g. http://127.0.0.1:8000
    model: str | None = None
    timeout_s: float = 600.0
    headers: dict[str, str] = field(default_factory=dict)

    def _request(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url.rstrip("/").removesuffix("/v1") + path, data=data,
                                         headers={"Content-Type": "application/json", **self.headers})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.load(response)
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{self.url}: HTTP {e.code}: {e.read()[:300].decode(errors='replace')}") from None

    def connect(self) -> str:
        """Check that the server answers `/v1/models` and settle the model (the first listed when
        `model` is None); raises ConnectionError saying why not (unreachable, not such a server)."""
        try:
            models = [m["id"] for m in self._request("/v1/models")["data"]]
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:  # URLError is an OSError
            raise ConnectionError(f"{self.url} is not an OpenAI-compatible server that answers: "
                                  f"{getattr(e, 'reason', None) or e}") from None
        if not models or (self.model is not None and self.model not in models):
            raise ConnectionError(f"{self.url} serves {models}, not {self.model!r}")
        self.model = self.model or models[0]
        return self.model

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if self.model is None:
            self.connect()
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": params.max_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "logprobs": 0,
                "stop_token_ids": list(params.stop_token_ids), "skip_special_tokens": False,
                "include_stop_str_in_output": True, "return_token_ids": True, "return_tokens_as_token_ids": True,
                "return_routed_experts": True}
        if params.seed is not None:
            body["seed"] = params.seed
        return parse_completion(self._request("/v1/completions", body), len(prompt_ids))


def parse_completion(reply: dict, prompt_len: int) -> Generation:
    """A `/v1/completions` response (one choice) to a Generation."""
    choice = reply["choices"][0]
    lp = choice.get("logprobs") or {}
    ids = choice.get("token_ids")
    if ids is None:
        ids = [int(t.rsplit(":", 1)[1]) for t in lp.get("tokens") or []]
    logprobs = [float(x) for x in lp.get("token_logprobs") or []]
    if len(logprobs) != len(ids):
        raise RuntimeError(f"endpoint returned {len(ids)} token ids but {len(logprobs)} logprobs")
    versions = choice.get("policy_versions") or [0] * len(ids)
    routing = choice.get("routed_experts")
    if routing is not None:  # generated token j was sampled reading position prompt_len - 1 + j
        routing = routing[prompt_len - 1: prompt_len - 1 + len(ids)]
    finish = "length" if choice.get("finish_reason") == "length" else "stop"
    return Generation(list(ids), logprobs, list(versions), choice.get("text", ""), routing, finish)
