"""The agent loop: one code path for training rollouts, `strop eval` and `strop agent`.

    prompt = system block (with tool schemas) + user instruction + generation prompt
    repeat: reset the window if full (_reset_due, _reset) -> policy.generate(ids) -> parse tool calls -> execute in the
            sandbox -> append the turn's separator + tool messages + generation prompt as forced tokens
    until:  submitted | no_tool_call | max_turns | context_full | turn_too_long | invalid_calls
            | policy_error | error

What the harness offers and how it speaks are declared, not built in: the tool set (`strop.env.harness.tools`:
`HarnessConfig.tools`, the built-in coding tools by default), the system prompt, and the chat format
(`strop.env.harness.chat_formats`: strop's own for its tiny models, else the checkpoint's chat template and
its tool-call parser). A harness checks its format's token-in-token-out invariant when it is built
and refuses a format that breaks it (`check_append_only`).

Token bookkeeping is append-only: generated ids go into the Segment exactly as the policy returned
them (loss_mask 1) and are never re-tokenized; everything the harness adds is tokenized once
(loss_mask 0). Text inside messages that spells a special token ("<|im_end|>" in a file the agent
read) is tokenized as plain text, so an observation cannot forge the chat structure.

`Harness.run` never raises: policy failures end the episode as "policy_error", anything else
unexpected (a dead sandbox) as "error", with the exception text in `Episode.detail`.

Messages: an assistant turn in canonical form (what the format renders for its parsed content and
calls) is stored parsed, in OpenAI form; any other turn is stored as its raw text, so the window's
messages render to the decoded tokens of the window.

Context windows: before every turn after the first, when the next turn (a full `max_turn_tokens`;
under "summarize" also the summary's room and an observation as long as the episode's longest so
far, so that the summary can see what that turn reads) would not fit in `max_context`, the
configured `context_strategy` (`strop.env.harness.context`) resets the window, at most once between two
turns and up to `max_resets` times: the episode goes on in a new Segment rendered from system +
task + the carried state. Under "summarize" the
carried state is the policy's own reply to a summary request, generated at the end of the full
window (so its tokens are trained like any action). Each reset is recorded in `Episode.resets`.
With no strategy (or no resets left), a full window ends the episode as "context_full".
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from strop.config import HarnessSection, RolloutSection
from strop.env.episode import Episode, Segment
from strop.env.harness.chat_formats import chat_format, check_append_only, load_parser, probe_windows
from strop.env.harness.context import SUMMARY_REQUEST, Strategy, carry, summary_state, truncate, turns
from strop.env.harness.tools import ToolSet, load_tools
from strop.env.sandbox.interface import WORKDIR, Limits, Sandbox
from strop.env.task import Task
from strop.errors import UserError
from strop.policy_api import PolicyClient, SamplingParams

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


_ROLLOUT, _HARNESS = RolloutSection(), HarnessSection()


@dataclass(frozen=True)
class HarnessConfig:
    """How the harness runs an episode. Its settings and their defaults are the run config's
    (`[rollout]` and `[harness]` in `strop.config`, where each is documented): `harness_config` builds
    one from a config, so `strop agent`, SFT, RL and evaluation cannot disagree on a default."""

    max_turns: int = _ROLLOUT.max_turns
    max_context: int = _ROLLOUT.max_context
    max_turn_tokens: int = _ROLLOUT.max_turn_tokens
    max_invalid_turns: int = _ROLLOUT.max_invalid_turns
    observation_chars: int = 2000  # a tool observation is clipped to this
    temperature: float = _ROLLOUT.temperature
    top_p: float = 1.0
    system: str = SYSTEM_PROMPT
    context_strategy: Strategy = _ROLLOUT.context_strategy
    max_resets: int = _ROLLOUT.max_resets
    summary_tokens: int = _ROLLOUT.summary_tokens
    summary_tail: int = _ROLLOUT.summary_tail
    keep_recent: int = _ROLLOUT.keep_recent
    tools: tuple[str, ...] = tuple(_HARNESS.tools)  # tool specs (`strop.env.harness.tools.load_tools`)
    chat_template: str = _HARNESS.chat_template  # `strop.env.harness.chat_formats.chat_format`
    tool_parser: str = _HARNESS.tool_parser


def harness_config(r: RolloutSection, h: HarnessSection | None = None) -> HarnessConfig:
    """The harness a run's `[rollout]` and `[harness]` sections describe (training, evaluation,
    demonstrations and `strop agent`). A tool file's path is made absolute, so that workers elsewhere
    find it."""
    declared = {}
    if h is not None:
        tools = tuple(_absolute(spec) for spec in h.tools)
        load_tools(tools)  # an unknown tool or a bad schema is refused here, before any work
        template = h.chat_template
        if template not in ("auto", "strop"):
            if not Path(template).is_file():
                raise UserError(f"config key 'harness.chat_template': {template!r} is not a file (or auto, strop)")
            template = str(Path(template).resolve())
        if h.tool_parser != "auto":
            load_parser(h.tool_parser)
        declared = {
            "tools": tools,
            "chat_template": template,
            "tool_parser": h.tool_parser,
            "system": system_prompt(h.system, h.system_file),
        }
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
        **declared,
    )


def _absolute(spec: str) -> str:
    new, eq, rest = spec.partition("=")
    if eq:
        return f"{new}={_absolute(rest)}"
    return str(Path(spec).resolve()) if spec.endswith((".toml", ".json")) and Path(spec).is_file() else spec


def system_prompt(text: str = "", path: str = "") -> str:
    """The system prompt `[harness]` declares: `text`, or the contents of the file `path`, with
    `{workdir}` replaced by the repository's path in the sandbox; strop's own when both are empty."""
    if text and path:
        raise UserError("config keys 'harness.system' and 'harness.system_file' are both set; keep one")
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"config key 'harness.system_file': cannot read {path!r}: {e}") from None
    return text.replace("{workdir}", WORKDIR).strip() if text else SYSTEM_PROMPT


class Harness:
    def __init__(
        self,
        tokenizer,
        config: HarnessConfig = HarnessConfig(),
        tools: ToolSet | None = None,
        on_message: Callable[[dict], None] | None = None,
    ):
        self.tokenizer, self.config = tokenizer, config
        self.tools = tools if tools is not None else load_tools(config.tools)
        self.schemas = self.tools.schemas()
        self.format = chat_format(tokenizer, config.chat_template, config.tool_parser)
        check_append_only(
            self.format, self.schemas, probe_windows(self.format, self.schemas, config.system, config.context_strategy)
        )
        self.on_message = on_message  # sees every assistant and tool message as it is appended (progress output)
        self.stop_ids = self.format.stop_ids

    def open_segment(self, messages: list[dict]) -> Segment:
        """A new context window rendered from `messages` (system first), ending in the generation prompt."""
        segment = Segment(messages=[dict(m) for m in messages], temperature=self.config.temperature)
        segment.add_forced(self.format.prompt(messages, self.schemas))
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
                    opened = self._reset(policy, ep, segment, pending, seed)
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

            raw = self.format.turn_text(gen.text)
            turn = self.format.parse(raw)
            # parsed, or the text as generated when not in canonical form (spacing, malformed calls);
            # the calls are in ep.tool_calls either way
            message = self.format.assistant_message(segment.messages, raw, turn, self.schemas)
            self._append(ep, segment.messages, [message])
            if gen.token_ids[-1] not in self.stop_ids:
                return "context_full" if params.max_tokens == room else "turn_too_long"
            if not turn.tool_calls and not turn.errors:
                return "no_tool_call"

            t = time.perf_counter()
            observations, submitted, rejected = [], False, 0
            for call in turn.tool_calls:
                result = self.tools.execute(sandbox, call.name, call.arguments, cfg.observation_chars)
                ep.tool_calls.append(self.tools.log(call.name, call.arguments, result))
                observations.append({"role": "tool", "tool_call_id": call.id, "content": result.output})
                rejected += result.error is not None
                if result.submitted:
                    submitted = True
                    break
            for problem in turn.errors:  # calls that did not parse: the model hears why
                ep.tool_calls.append(
                    {"name": "", "role": None, "arguments": "", "output": f"error: {problem}", "error": problem}
                )
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
            # the separator that closes the generated turn (not a policy token), then the observations
            pending_ids = self.format.after_turn(segment.messages, observations, self.schemas)
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

    # -- context resets (strop.env.harness.context) -------------------------------------------------

    def count(self, messages: list[dict]) -> int:
        """Tokens `messages` take in a window."""
        return self.format.count(messages)

    def _summary_room(self) -> int:
        return self.count([SUMMARY_MESSAGE]) + self.format.generation_prompt_tokens + self.config.summary_tokens

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
            # the last turn's observations, the request and the generation prompt
            asked = self.format.after_turn(segment.messages, pending + [SUMMARY_MESSAGE], self.schemas)
            unseen: list[dict] = []
            if len(segment) + len(asked) + cfg.summary_tokens > cfg.max_context:
                # the last observations ran long: summarize without them and carry that turn verbatim
                unseen = turns(segment.messages[len(head) :])[-1] + pending
                pending = []
                asked = self.format.after_turn(segment.messages, [SUMMARY_MESSAGE], self.schemas)
            # bounded by summary_tokens, and by what is left of the window
            max_tokens = min(cfg.summary_tokens, cfg.max_context - len(segment) - len(asked))
            if max_tokens < MIN_TURN_TOKENS:
                return None
            segment.add_forced(asked)
            segment.messages += pending + [dict(SUMMARY_MESSAGE)]
            self._append(ep, None, [dict(SUMMARY_MESSAGE)])
            salt = None if seed is None else seed + 1_000_003 * (len(ep.resets) + 1)  # apart from the turns' seeds
            gen = self._generate(policy, segment, self._params(max_tokens, salt), ep)
            raw = self.format.turn_text(gen.text)  # cut short at summary_tokens, it is still the summary
            self._append(ep, segment.messages, [{"role": "assistant", "content": raw}])
            seen = history[: len(history) - len(unseen)]
            summary = min((raw.split(t, 1)[0] for t in self.format.stop_texts), key=len).strip()
            carried = summary_state(summary, seen, cfg.summary_tail, room, self.count)
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
    from strop.env.world.task_world import prepare_world, task_sandbox

    with task_sandbox(task, limits) as sandbox:
        prepare_world(
            sandbox, task, limits.timeout_s
        )  # a setup that fails leaves the world as it is: the agent's to see
        episode = harness.run(policy, sandbox, task.instruction, seed=seed)
        changes = sandbox.diff()
    return episode, changes
