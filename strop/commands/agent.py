"""`strop agent --repo DIR "instruction"`: the production harness on a real directory.

The agent works in a sandbox over a copy-on-write view of DIR, so nothing touches DIR while it
runs; at the end its changes are printed as a unified diff and written to DIR only with `--apply`
(or a "y" at the prompt on a terminal). The policy is an OpenAI-compatible server
(`--endpoint URL`, with `--tokenizer DIR` for the chat format's token ids) or a local checkpoint
run by the in-process engine (`--checkpoint DIR`).

Against a `strop serve` with keys, the key in `$STROP_API_KEY` (scopes infer + feedback) is
presented, and the session's outcome is reported as feedback: each served completion that edited a
file is rated `edit` / `kept` when the diff is applied and `edit` / `reverted` when it is not, the
ratings the online cycle learns from (`strop online`).
"""

import argparse
import difflib
import json
import math
import secrets
import sys
from dataclasses import replace
from pathlib import Path

from strop.confined import apply_changes, read_beneath
from strop.env.harness.context import STRATEGIES
from strop.errors import UserError
from strop.outputs import write_atomic
from strop.terminal import printable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("instruction", help="what the agent should do")
    parser.add_argument("--repo", required=True, help="the directory the agent works on (read-only unless --apply)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--endpoint", help="URL of an OpenAI-compatible server with /v1/completions")
    source.add_argument("--checkpoint", help="a strop checkpoint directory, run by the in-process engine")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's; needed with --endpoint)")
    parser.add_argument("--model", help="model name sent to the endpoint (default: the first one it lists)")
    # the harness's settings are the run config's (--config, else its defaults); these flags override them
    parser.add_argument("--max-turns", type=int, help="assistant turns before the episode stops (rollout.max_turns)")
    parser.add_argument("--max-context", type=int, help="context window in tokens (rollout.max_context)")
    parser.add_argument(
        "--context-strategy",
        choices=STRATEGIES,
        help="what a full context window carries into the next (rollout.context_strategy; strop.env.harness.context)",
    )
    parser.add_argument(
        "--max-resets", type=int, help="context resets before a full window ends the episode (rollout.max_resets)"
    )
    parser.add_argument(
        "--temperature", type=float, help="sampling temperature, 0 = greedy (rollout.eval_temperature: as evaluated)"
    )
    parser.add_argument(
        "--seed",
        type=int,
        help="sampling seed: the same seed, policy, repository and settings give the same episode (default: a new "
        "one each run, printed at the end)",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="default wall-clock limit per command, seconds")
    parser.add_argument("--apply", action="store_true", help="write the agent's changes to --repo without asking")
    parser.add_argument("--json", help="write the episode (tokens, messages, tool calls) to this JSON file")
    parser.add_argument(
        "--log-session",
        metavar="JSONL",
        help="append the session to this file as OpenAI-format chat conversations (one line per context "
        "window), the format `sft.traces` trains on",
    )
    parser.add_argument(
        "--config",
        help="a run config whose [rollout] and [harness] settings (turns, context, sandbox limits, tools, system "
        "prompt, chat template) the agent uses; without one, the config defaults",
    )


def _policy(args):
    """(policy client, tokenizer, largest context the policy holds or None)."""
    from strop.data.tokenizer import load_tokenizer
    from strop.engine.endpoint import EndpointClient
    from strop.runtime.engines import api_key_headers

    if args.checkpoint:
        from strop.engine.engine import Engine
        from strop.engine.policy_client import EnginePolicy

        if not Path(args.checkpoint).is_dir():
            raise UserError(f"--checkpoint {args.checkpoint!r} is not a directory")
        engine = Engine.from_checkpoint(args.checkpoint, max_batch=1)
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else engine.tokenizer
        return EnginePolicy(engine), tokenizer, engine.max_len
    if not args.tokenizer:
        raise UserError("--endpoint needs --tokenizer DIR (the policy's tokenizer, for the chat format's token ids)")
    # what it was served is recorded for the session's feedback (`report_edits`)
    client = EndpointClient(args.endpoint, model=args.model, headers=api_key_headers(), served=[])
    try:
        client.connect()  # before the sandbox starts: an unreachable endpoint is a user mistake
    except ConnectionError as e:
        raise UserError(f"--endpoint: {e}") from None
    return client, load_tokenizer(args.tokenizer), None


def _show(message: dict) -> None:
    """Print a message of the episode as it happens; what the policy and the tools wrote goes through
    `strop.terminal.printable`, so their escape sequences are shown, never obeyed."""
    from strop.env.harness.tools import describe_call

    if message["role"] == "assistant":
        if message.get("content"):
            print(printable(f"agent: {message['content'][:500]}"))
        for call in message.get("tool_calls") or []:
            args = call["function"]["arguments"]
            print(printable(f"  -> {describe_call(call['function']['name'], json.loads(args))}"))
    else:
        lines = (message.get("content") or "").splitlines() or [""]
        print(
            printable(
                "     "
                + "\n     ".join(lines[:6])
                + (f"\n     ... ({len(lines) - 6} more lines)" if len(lines) > 6 else "")
            )
        )
    sys.stdout.flush()


def _unified(repo_dir: Path, path: str, new: bytes | None) -> str:
    old = read_beneath(repo_dir, path)  # never through a link: a file outside DIR is not shown
    try:
        a, b = (old or b"").decode().splitlines(keepends=True), (new or b"").decode().splitlines(keepends=True)
    except UnicodeDecodeError:
        return f"Binary file {path} {'deleted' if new is None else 'differs'}\n"
    src = f"a/{path}" if old is not None else "/dev/null"
    return "".join(difflib.unified_diff(a, b, src, "/dev/null" if new is None else f"b/{path}"))


def report_edits(policy, kept: bool, roles: dict[str, str]) -> None:
    """Rate the session's editing completions (a call of a tool whose role in `roles` is "edit") kept
    or reverted, where the server takes feedback."""
    from strop.data.chat import parse_assistant
    from strop.engine.endpoint import EndpointClient, EndpointError

    if not isinstance(policy, EndpointClient) or policy.served is None or "Authorization" not in policy.headers:
        return
    edits = [
        cid for cid, text in policy.served if any(roles.get(c.name) == "edit" for c in parse_assistant(text).tool_calls)
    ]
    try:
        for cid in edits:
            policy.feedback(cid, "edit", "kept" if kept else "reverted")
    except (EndpointError, OSError) as e:  # the session's result stands; only the rating is lost
        print(f"feedback not recorded: {e}")
        return
    if edits:
        print(f"reported {len(edits)} edit(s) as {'kept' if kept else 'reverted'}")


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    set_threads(1)
    from strop.config import load_config
    from strop.env.grading.checker import source_changes
    from strop.env.harness.loop import Harness, harness_config
    from strop.env.harness.sessions import append_conversations, check_log, episode_conversations
    from strop.env.sandbox.backend import open_sandbox
    from strop.rl.rollout import sandbox_limits

    repo_dir = Path(args.repo)
    if not repo_dir.is_dir():
        raise UserError(f"--repo {args.repo!r} is not a directory")
    if args.max_resets is not None and args.max_resets < 0:
        raise UserError(f"--max-resets must be >= 0, got {args.max_resets}")
    for flag, value, low in (("--max-turns", args.max_turns, 1), ("--max-context", args.max_context, 64)):
        if value is not None and value < low:
            raise UserError(f"{flag} must be at least {low}, got {value}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UserError(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature must be a number >= 0, got {args.temperature}")
    if args.log_session:
        check_log(args.log_session, "--log-session")  # before the episode, not after it
    run_cfg = load_config(args.config)
    config = harness_config(run_cfg.rollout, run_cfg.harness)  # a refused tool set or chat template: before any work
    flags = {
        "max_turns": args.max_turns,
        "max_context": args.max_context,
        "context_strategy": args.context_strategy,
        "max_resets": args.max_resets,
        "temperature": run_cfg.rollout.eval_temperature if args.temperature is None else args.temperature,
    }
    config = replace(config, **{k: v for k, v in flags.items() if v is not None})
    policy, tokenizer, max_len = _policy(args)
    config = replace(config, max_context=min(config.max_context, max_len or config.max_context))
    harness = Harness(tokenizer, config, on_message=_show)  # a refused tool set or chat template: before any work
    seed = secrets.randbelow(2**31) if args.seed is None else args.seed
    sandbox = open_sandbox(repo_dir, replace(sandbox_limits(run_cfg.rollout), timeout_s=args.timeout))
    try:
        episode = harness.run(policy, sandbox, args.instruction, seed=seed)
        changes = sandbox.diff()
    finally:
        sandbox.close()
    detail = f" ({episode.detail})" if episode.detail else ""
    print(
        f"\nstopped: {episode.stop_reason}{detail} after {episode.turns} turns, {episode.generated_tokens} "
        f"generated tokens, {episode.timings['total_s']:.1f} s (seed {seed})"
    )
    if args.json:
        write_atomic(args.json, json.dumps(episode.to_dict()))
    if args.log_session:
        logged = episode_conversations(episode, harness, {"instruction": args.instruction})
        append_conversations(args.log_session, logged, "--log-session")
        print(f"logged {len(logged)} conversation(s) to {args.log_session}")
    changes = source_changes(changes)  # caches of running code are neither shown nor applied
    if not changes:
        print("no changes")
    else:
        print(printable("".join(_unified(repo_dir, p, d) for p, d in sorted(changes.items()))), end="")
        apply = args.apply
        if not apply and sys.stdin.isatty():
            apply = input(f"apply {len(changes)} changed file(s) to {repo_dir}? [y/N] ").strip().lower() == "y"
        if apply:
            try:
                apply_changes(repo_dir, changes)  # all or nothing, never through a link out of DIR
            except UserError as e:
                raise UserError(f"nothing applied to {repo_dir}: {e}") from None
            print(f"applied {len(changes)} file(s) to {repo_dir}")
        else:
            print(f"not applied (rerun with --apply to write them to {repo_dir})")
        report_edits(policy, kept=bool(apply), roles=harness.tools.roles())
    return 1 if episode.stop_reason in ("policy_error", "error") else 0
