"""The agent loop: one code path for training rollouts, `strop eval` and `strop agent`.

    prompt = system block (with tool schemas) + user instruction + "<|im_start|>assistant\\n"
    repeat: consult context_budget -> policy.generate(ids) -> parse tool calls -> execute in the
            sandbox -> append "\\n" + tool messages + generation prompt as forced tokens
    until:  submitted | no_tool_call | max_turns | context_full | turn_too_long | invalid_calls
            | policy_error | error

Token bookkeeping is append-only: generated ids go into the Segment exactly as the policy returned
them (loss_mask 1) and are never re-tokenized; everything the harness adds is tokenized once
(loss_mask 0). Text inside messages that spells a special token ("<|im_end|>" in a file the agent
read) is tokenized as plain text, so an observation cannot forge the chat structure.

`Harness.run` never raises: policy failures end the episode as "policy_error", anything else
unexpected (a dead sandbox) as "error", with the exception text in `Episode.detail`.

Messages: an assistant turn in canonical form (what `render_message` produces for its parsed
content and calls) is stored parsed, in OpenAI form; any other turn is stored as its raw text, so
`render(segment.messages)` always reproduces the decoded tokens of the window.

Context windows: before every turn after the first, when the next turn (a full `max_turn_tokens`;
under "summarize" also the summary's room and an observation as long as the episode's longest so
far, so that the summary can see what that turn reads) would not fit in `max_context`, the
configured `context_strategy` (`strop.env.context`) resets the window, at most once between two
turns and up to `max_resets` times: the episode goes on in a new Segment rendered from system +
task + the carried state. Under "summarize" the
carried state is the policy's own reply to a summary request, generated at the end of the full
window (so its tokens are trained like any action). Each reset is recorded in `Episode.resets`.
With no strategy (or no resets left), a full window ends the episode as "context_full".
"""

import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from strop.data.chat import (
    EOS,
    GENERATION_PROMPT,
    IM_END,
    SPECIAL_TOKENS,
    parse_assistant,
    render_message,
    render_system,
)
from strop.env.context import SUMMARY_REQUEST, Strategy, carry, summary_state, truncate, turns
from strop.env.sandbox import WORKDIR, Limits, Sandbox, open_sandbox, scratch_dir
from strop.env.segment import Episode, Segment
from strop.env.task import Task
from strop.env.tools import TOOLS, execute
from strop.policy_api import PolicyClient, SamplingParams

if TYPE_CHECKING:
    from strop.config import RolloutSection

SYSTEM_PROMPT = (
    f"You are a coding agent in the repository {WORKDIR}. Use the tools to inspect and fix code, then call submit."
)
STOP_REASONS = (
    "submitted",
    "no_tool_call",
    "max_turns",
    "context_full",
    "turn_too_long",
    "invalid_calls",
    "policy_error",
    "error",
)
MIN_TURN_TOKENS = 16  # a window with less room than this cannot hold a useful turn
SUMMARY_MESSAGE = {"role": "user", "content": SUMMARY_REQUEST}


@dataclass(frozen=True)
class HarnessConfig:
    max_turns: int = 20
    max_context: int = 2048  # tokens per context window (the policy's window)
    max_turn_tokens: int = 512  # tokens per assistant turn
    max_invalid_turns: int = 3  # consecutive turns whose every call was rejected end the episode
    observation_chars: int = 2000  # a tool observation is clipped to this
    temperature: float = 1.0
    top_p: float = 1.0
    system: str = SYSTEM_PROMPT
    context_strategy: Strategy = "none"  # what a full window carries into the next (strop.env.context)
    max_resets: int = 8  # context resets per episode
    summary_tokens: int = 192  # "summarize": most tokens of one summary
    summary_tail: int = 0  # "summarize": recent turns carried verbatim after the summary
    keep_recent: int = 2  # "masking", "compaction": recent tool observations kept in full


def harness_config(r: "RolloutSection") -> HarnessConfig:
    """The harness a run's `[rollout]` section describes (training, evaluation and demonstrations)."""
    return HarnessConfig(
        max_turns=r.max_turns,
        max_context=r.max_context,
        max_turn_tokens=r.max_turn_tokens,
        max_invalid_turns=r.max_invalid_turns,
        temperature=r.temperature,
        context_strategy=r.context_strategy,
        max_resets=r.max_resets,
        summary_tokens=r.summary_tokens,
        summary_tail=r.summary_tail,
        keep_recent=r.keep_recent,
    )


class Harness:
    def __init__(
        self,
        tokenizer,
        config: HarnessConfig = HarnessConfig(),
        tools: list[dict] = TOOLS,
        on_message: Callable[[dict], None] | None = None,
    ):
        self.tokenizer, self.config, self.tools = tokenizer, config, tools
        self.on_message = on_message  # sees every assistant and tool message as it is appended (progress output)
        self.stop_ids = tuple(tokenizer.convert_tokens_to_ids(t) for t in (IM_END, EOS))

    # -- tokenization (forced tokens only) --------------------------------------------------

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_message(self, message: dict) -> list[int]:
        """`render_message(message)` as token ids, with special-token spellings inside the content
        tokenized as plain text."""
        content = message.get("content") or ""
        if not any(s in content for s in SPECIAL_TOKENS):
            return self._encode(render_message(message))
        sentinel = "\x00content\x00"
        head, tail = render_message({**message, "content": sentinel}).split(sentinel)
        body = self.tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
        return self._encode(head) + body + self._encode(tail)

    def open_segment(self, messages: list[dict]) -> Segment:
        """A new context window rendered from `messages` (system first), ending in the generation prompt."""
        assert messages and messages[0]["role"] == "system", "a context window starts with the system message"
        ids = self._encode(render_system(self.tools, messages[0]["content"]))
        for m in messages[1:]:
            ids += self.encode_message(m)
        segment = Segment(messages=[dict(m) for m in messages], temperature=self.config.temperature)
        segment.add_forced(ids + self._encode(GENERATION_PROMPT))
        return segment

    # -- the loop ---------------------------------------------------------------------------

    def run(self, policy: PolicyClient, sandbox: Sandbox, instruction: str, seed: int | None = None) -> Episode:
        cfg = self.config
        start = time.perf_counter()
        episode = Episode(
            segments=[],
            messages=[{"role": "system", "content": cfg.system}, {"role": "user", "content": instruction}],
            tool_calls=[],
            stop_reason="",
            turns=0,
            timings={"policy_s": 0.0, "tools_s": 0.0},
        )
        try:
            episode.stop_reason = self._loop(policy, sandbox, episode, seed)
        except _PolicyError as e:
            episode.stop_reason, episode.detail = "policy_error", str(e)
        except Exception as e:  # the episode boundary: a broken world ends this episode, not the run
            episode.stop_reason, episode.detail = "error", f"{type(e).__name__}: {e}"
        episode.timings["total_s"] = time.perf_counter() - start
        return episode

    def _loop(self, policy: PolicyClient, sandbox: Sandbox, ep: Episode, seed: int | None) -> str:
        cfg = self.config
        segment = self.open_segment(ep.messages)
        ep.segments.append(segment)
        pending_ids: list[int] = []  # forced tokens (observations + generation prompt) not yet committed
        pending: list[dict] = []
        longest_observation = 0  # tokens; predicts the next turn's under "summarize" (see _reset_due)
        invalid_turns = 0
        while True:
            if ep.turns >= cfg.max_turns:
                return "max_turns"
            if ep.turns:
                longest_observation = max(longest_observation, len(pending_ids))
                if self._reset_due(len(segment) + len(pending_ids), longest_observation, ep):
                    opened = self._reset(policy, ep, segment, pending_ids, pending, seed)
                    if opened is None:
                        return "context_full"
                    segment = opened
                    ep.segments.append(segment)
                elif len(segment) + len(pending_ids) + MIN_TURN_TOKENS > cfg.max_context:
                    return "context_full"
                else:
                    segment.add_forced(pending_ids)
                    segment.messages += pending
            room = cfg.max_context - len(segment)
            if room < MIN_TURN_TOKENS:
                return "context_full"

            params = self._params(min(cfg.max_turn_tokens, room), None if seed is None else seed + ep.turns)
            gen = self._generate(policy, segment, params, ep)
            ep.turns += 1

            raw = gen.text.split(IM_END, 1)[0]
            turn = parse_assistant(raw.split(EOS, 1)[0])
            message = {"role": "assistant", "content": turn.content}
            if turn.tool_calls:
                message["tool_calls"] = [c.to_openai() for c in turn.tool_calls]
            if render_message(message) != f"{GENERATION_PROMPT}{raw}{IM_END}\n":
                # not in canonical form (spacing, malformed calls): keep the text as generated, so the
                # window's messages still render to its tokens; the calls are in ep.tool_calls
                message = {"role": "assistant", "content": raw}
            self._append(ep, segment.messages, [message])
            if gen.token_ids[-1] not in self.stop_ids:
                return "context_full" if params.max_tokens == room else "turn_too_long"
            if not turn.tool_calls and not turn.errors:
                return "no_tool_call"

            t = time.perf_counter()
            observations, submitted, rejected = [], False, 0
            for call in turn.tool_calls:
                result = execute(sandbox, call.name, call.arguments, cfg.observation_chars)
                ep.tool_calls.append(result.log(call.name, call.arguments))
                observations.append({"role": "tool", "tool_call_id": call.id, "content": result.output})
                rejected += result.error is not None
                if result.submitted:
                    submitted = True
                    break
            for problem in turn.errors:  # calls that did not parse: the model hears why
                ep.tool_calls.append({"name": "", "arguments": "", "output": f"error: {problem}", "error": problem})
                observations.append({"role": "tool", "content": f"error: {problem}"})
                rejected += 1
            ep.timings["tools_s"] += time.perf_counter() - t
            if submitted:
                self._append(ep, None, observations)
                return "submitted"
            invalid_turns = invalid_turns + 1 if rejected == len(observations) else 0
            if invalid_turns >= cfg.max_invalid_turns:
                self._append(ep, None, observations)
                return "invalid_calls"
            # "\n" closes the generated turn (a separator, not a policy token), then the observations
            pending_ids = self._encode("\n") + [i for m in observations for i in self.encode_message(m)]
            pending_ids += self._encode(GENERATION_PROMPT)
            pending = observations
            self._append(ep, None, observations)

    def _params(self, max_tokens: int, seed: int | None) -> SamplingParams:
        cfg = self.config
        return SamplingParams(
            max_tokens=max_tokens, temperature=cfg.temperature, top_p=cfg.top_p, stop_token_ids=self.stop_ids, seed=seed
        )

    def _generate(self, policy: PolicyClient, segment: Segment, params: SamplingParams, ep: Episode):
        """One policy call on the window, its tokens appended to `segment` as generated."""
        t = time.perf_counter()
        try:
            gen = policy.generate(list(segment.input_ids), params)
        except Exception as e:  # an engine or endpoint failure is the policy's, not the episode's
            raise _PolicyError(f"{type(e).__name__}: {e}") from None
        ep.timings["policy_s"] += time.perf_counter() - t
        if not gen.token_ids or len(gen.token_ids) > params.max_tokens:
            raise _PolicyError(f"policy returned {len(gen.token_ids)} tokens for max_tokens={params.max_tokens}")
        segment.add_generated(gen.token_ids, gen.logprobs, gen.versions, gen.routing)
        return gen

    # -- context resets (strop.env.context) -------------------------------------------------

    def count(self, messages: list[dict]) -> int:
        return sum(len(self.encode_message(m)) for m in messages)

    def _summary_room(self) -> int:
        return self.count([SUMMARY_MESSAGE]) + len(self._encode(GENERATION_PROMPT)) + self.config.summary_tokens

    def _reset_due(self, n_tokens: int, longest_observation: int, ep: Episode) -> bool:
        cfg = self.config
        if cfg.context_strategy == "none" or len(ep.resets) >= cfg.max_resets:
            return False
        if ep.resets and ep.resets[-1]["turn"] == ep.turns:
            return False  # a window that cannot hold one turn after its carried state: no reset loop
        # A summary written without the last turn's observations carries that turn verbatim (_reset),
        # and a carried state of whole files is what summarizing is for avoiding: so room is kept for
        # an observation as long as the longest yet.
        reserve = self._summary_room() + longest_observation if cfg.context_strategy == "summarize" else 0
        return n_tokens + cfg.max_turn_tokens + reserve > cfg.max_context

    def _reset(
        self,
        policy: PolicyClient,
        ep: Episode,
        segment: Segment,
        pending_ids: list[int],
        pending: list[dict],
        seed: int | None,
    ) -> Segment | None:
        """Close the full window and open the next from system + task + the carried state; None when
        not even a short summary fits in what is left of the window."""
        cfg = self.config
        head = ep.messages[:2]  # the system message and the task
        room = cfg.max_context - cfg.max_turn_tokens - len(self.open_segment(head))
        history = segment.messages[len(head) :] + pending
        if cfg.context_strategy == "summarize":
            ask = self.encode_message(SUMMARY_MESSAGE) + self._encode(GENERATION_PROMPT)
            observed = pending_ids[: -len(self._encode(GENERATION_PROMPT))]  # "\n" + the last turn's observations
            unseen: list[dict] = []
            if len(segment) + len(observed) + len(ask) + cfg.summary_tokens > cfg.max_context:
                # the last observations ran long: summarize without them and carry that turn verbatim
                unseen = turns(segment.messages[len(head) :])[-1] + pending
                observed, pending = self._encode("\n"), []
            # bounded by summary_tokens, and by what is left of the window
            max_tokens = min(cfg.summary_tokens, cfg.max_context - len(segment) - len(observed) - len(ask))
            if max_tokens < MIN_TURN_TOKENS:
                return None
            segment.add_forced(observed + ask)
            segment.messages += pending + [dict(SUMMARY_MESSAGE)]
            self._append(ep, None, [dict(SUMMARY_MESSAGE)])
            salt = None if seed is None else seed + 1_000_003 * (len(ep.resets) + 1)  # apart from the turns' seeds
            gen = self._generate(policy, segment, self._params(max_tokens, salt), ep)
            raw = gen.text.split(IM_END, 1)[0]  # cut short at summary_tokens, it is still the summary
            self._append(ep, segment.messages, [{"role": "assistant", "content": raw}])
            seen = history[: len(history) - len(unseen)]
            carried = summary_state(raw.split(EOS, 1)[0].strip(), seen, cfg.summary_tail, room, self.count)
            carried += truncate(unseen, room - self.count(carried), self.count)
        else:
            carried = carry(cfg.context_strategy, history, ep.tool_calls, cfg.keep_recent, room, self.count)
        ep.resets.append(
            {"turn": ep.turns, "calls": len(ep.tool_calls), "carried": carried, "carried_tokens": self.count(carried)}
        )
        return self.open_segment(head + carried)

    def _append(self, ep: Episode, window: list[dict] | None, messages: list[dict]) -> None:
        ep.messages += messages
        if window is not None:
            window += messages
        if self.on_message:
            for m in messages:
                self.on_message(m)


class _PolicyError(Exception):
    pass


def run_task(
    harness: Harness, policy: PolicyClient, task: Task, limits: Limits = Limits(), seed: int | None = None
) -> tuple[Episode, dict[str, bytes | None]]:
    """One episode on `task` in a fresh sandbox over its starting repository; returns the episode
    and the workspace changes (relative path -> bytes, None = deleted) for the checker."""
    from strop.env.checker import materialize

    world = scratch_dir("world")
    try:
        materialize(task, world)
        sandbox = open_sandbox(world, limits)
        try:
            episode = harness.run(policy, sandbox, task.instruction, seed=seed)
            changes = sandbox.diff()
        finally:
            sandbox.close()
    finally:
        shutil.rmtree(world, ignore_errors=True)
    return episode, changes
