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

    The request sends the prompt as a list of token ids and asks for per-token logprobs and the
    sampled ids (`return_token_ids`, as vLLM; vLLM's older `return_tokens_as_token_ids` form of
    `logprobs.tokens`, "token_id:N", is read too). Optional response fields strop's engine server
    adds: `choices[0].versions` (per token) or a top-level `policy_version`, and
    `choices[0].routed_experts` (per token, per MoE layer).
    """

    url: str  # the server root, e.g. http://127.0.0.1:8000
    model: str = "default"
    timeout_s: float = 600.0
    headers: dict[str, str] = field(default_factory=dict)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": params.max_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "logprobs": 0,
                "stop_token_ids": list(params.stop_token_ids), "skip_special_tokens": False,
                "include_stop_str_in_output": True, "return_token_ids": True, "return_tokens_as_token_ids": True}
        if params.seed is not None:
            body["seed"] = params.seed
        request = urllib.request.Request(self.url.rstrip("/") + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json", **self.headers})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                reply = json.load(response)
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{self.url}: HTTP {e.code}: {e.read()[:300].decode(errors='replace')}") from None
        return parse_completion(reply)


def parse_completion(reply: dict) -> Generation:
    """A `/v1/completions` response (one choice) to a Generation."""
    choice = reply["choices"][0]
    lp = choice.get("logprobs") or {}
    ids = choice.get("token_ids")
    if ids is None:
        ids = [int(t.rsplit(":", 1)[1]) for t in lp.get("tokens") or []]
    logprobs = [float(x) for x in lp.get("token_logprobs") or []]
    if len(logprobs) != len(ids):
        raise RuntimeError(f"endpoint returned {len(ids)} token ids but {len(logprobs)} logprobs")
    versions = choice.get("versions") or [int(reply.get("policy_version", 0))] * len(ids)
    finish = "length" if choice.get("finish_reason") == "length" else "stop"
    return Generation(list(ids), logprobs, list(versions), choice.get("text", ""), choice.get("routed_experts"), finish)
