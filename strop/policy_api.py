"""The engine boundary: what the harness asks a policy for (the next assistant turn as token ids,
given the token ids of the context so far, under `SamplingParams`) and what it gets back (a
`Generation`). Every engine and client speaks these types: the in-process engine
(`strop.engine.policy_client.EnginePolicy`), an OpenAI-compatible HTTP endpoint
(`strop.engine.endpoint.EndpointClient`, for strop's server and vLLM alike), the Ray engine actor
and the scripted oracle all implement `PolicyClient`. This module imports nothing of strop, so the
engine can implement it without the environment knowing any engine.

Token ids in, token ids out: the harness never re-tokenizes generated text, so the tokens trained
on are exactly the tokens sampled, with the logprobs, policy versions and (for MoE) expert routing
the engine reported for them.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    stop_token_ids: Sequence[int] | None = (
        None  # generation ends after one of these (it is returned); None = the engine's end tokens
    )
    stop: Sequence[
        str
    ] = ()  # stop strings: generation ends once the text holds one (cut from the text, kept in token_ids)
    seed: int | None = None


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each sampled token under the behaviour policy
    versions: list[int]  # policy version that sampled each token (weights can change mid-turn)
    text: str  # token_ids decoded, special tokens kept
    routing: list[list[list[int]]] | None = None  # per generated token, per MoE layer: expert ids
    finish_reason: str = "stop"  # "stop" (a stop token ended it) or "length" (max_tokens did)


class PolicyClient(Protocol):
    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...


def generated_routing(routing, prompt_len: int, n_generated: int) -> list[list[list[int]]] | None:
    """The routing of each generated token, from an engine's routing of every position it read
    ([prompt + generated - 1, MoE layers, top_k], as strop's engine and vLLM return it, an array or
    nested lists): generated token j was sampled reading position prompt_len - 1 + j. None stays None."""
    if routing is None:
        return None
    rows = routing[prompt_len - 1 : prompt_len - 1 + n_generated]
    return rows.tolist() if hasattr(rows, "tolist") else [list(r) for r in rows]
