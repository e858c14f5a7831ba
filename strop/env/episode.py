"""The token-level records of an episode: `Segment` (one context window) and `Episode` (the
whole agent run). Plain data, JSON-serialisable, so rollout workers, the buffer and the trainer
exchange them as files or messages.

All per-token lists of a Segment are aligned with `input_ids`. On forced tokens (prompt, tool
observations, separators) `loss_mask` is 0, `behavior_logprobs` 0.0, `versions` -1 and `routing`
None; on tokens the policy generated they hold what the engine reported when it sampled them —
for `routing`, the experts of the position whose output the token was sampled from (token j's
entry is position j - 1's routing).
"""

from dataclasses import asdict, dataclass, field


@dataclass
class Segment:
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 exactly on policy-generated tokens
    behavior_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # policy version that sampled each token
    routing: list[list[list[int]] | None] = field(default_factory=list)  # per token: expert ids per MoE layer
    messages: list[dict] = field(default_factory=list)  # what this window rendered from (tokens are authoritative)
    # The sampling temperature its generated tokens were drawn at: behavior_logprobs are under the
    # tempered distribution, so the trainer scores them at the same temperature.
    temperature: float = 1.0

    def __len__(self) -> int:
        return len(self.input_ids)

    def add_forced(self, ids: list[int]) -> None:
        n = len(ids)
        self.input_ids += ids
        self.loss_mask += [0] * n
        self.behavior_logprobs += [0.0] * n
        self.versions += [-1] * n
        self.routing += [None] * n

    def add_generated(self, ids: list[int], logprobs: list[float], versions: list[int], routing: list | None) -> None:
        n = len(ids)
        assert len(logprobs) == n and len(versions) == n, "policy returned misaligned token data"
        assert routing is None or len(routing) == n, "policy returned misaligned routing"
        self.input_ids += ids
        self.loss_mask += [1] * n
        self.behavior_logprobs += logprobs
        self.versions += versions
        self.routing += routing if routing is not None else [None] * n

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "Segment":
        return Segment(**d)


@dataclass
class Episode:
    """One agent run. `tool_calls` is the log the hack monitor reads: one dict per call with
    `name`, `arguments` (dict, or the raw text when it did not parse), `output` and `error`
    (None, or why the call was rejected or failed)."""

    segments: list[Segment]
    messages: list[dict]  # the whole conversation across context windows, system message first
    tool_calls: list[dict]
    stop_reason: str
    turns: int  # assistant turns generated
    timings: dict[str, float]  # policy_s, tools_s, total_s
    detail: str = ""  # the exception text when stop_reason is "policy_error" or "error"
    # One dict per context reset (strop.env.harness.context): `turn` and `calls` (turns and tool calls before
    # it), `carried` (the messages after system and task that opened the next window), `carried_tokens`.
    resets: list[dict] = field(default_factory=list)

    @property
    def generated_tokens(self) -> int:
        return sum(sum(s.loss_mask) for s in self.segments)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "Episode":
        return Episode(**{**d, "segments": [Segment.from_dict(s) for s in d["segments"]]})
