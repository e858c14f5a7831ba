"""`strop serve`: a checkpoint behind the OpenAI-compatible API (see `strop.engine.server`), with API
keys, a completion log, ratings and store-only weight updates (`strop.online.app`).

Without `--keys` the server is open and may only listen on loopback, and has no weight routes;
`--host` on any other interface needs `--keys`. `--store` logs every completion and takes
`POST /v1/feedback`; `--weights-store` (with `--keys`) lets an admin key move the served weights
to a version of the run's store, or back.

Impossible settings (a port outside 0-65535, no KV-cache slot, a context past the model's limit)
and a port already in use are refused before the model loads, as one line and exit 2. On SIGTERM
or Ctrl-C requests in flight get `GRACEFUL_S` seconds to finish; then they are cancelled (which
cancels their generation), and uvicorn re-raises the signal: SIGTERM exits 143 like any command.
"""

import argparse
import ipaddress
import socket
import sys
from pathlib import Path

from strop.errors import UserError

GRACEFUL_S = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="model directory (config.json, *.safetensors, tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    parser.add_argument("--name", help="served model name (default: the directory name)")
    parser.add_argument("--max-batch", type=int, default=64, help="concurrent sequences (KV-cache slots)")
    parser.add_argument(
        "--max-len", type=int, default=None, help="longest sequence (default: model limit, at most 2048)"
    )
    parser.add_argument(
        "--deterministic", action="store_true", help="batch-invariant ops: logprobs equal the trainer's bit for bit"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: STROP_THREADS or all cores)")
    parser.add_argument("--keys", help="API key file (`strop serve key`); required off loopback")
    parser.add_argument("--store", help="completion log and feedback store: a SQLite path or a postgresql:// URL")
    parser.add_argument(
        "--weights-store", help="the run's weight store (directory or fsspec URL) admin updates load from"
    )
    parser.add_argument(
        "--chat-template",
        default="auto",
        help="how chat completions render: auto (the checkpoint's own template; strop's format for strop's "
        "models), strop, or a Jinja template file",
    )
    parser.add_argument(
        "--tool-parser",
        default="auto",
        help="tool-call syntax of a checkpoint's template: auto, hermes, llama3_json, none (a template "
        "without tool calls, as SmolLM2-Instruct's), or a dotted path",
    )
    parser.add_argument(
        "--log-sessions",
        metavar="JSONL",
        help="append every chat completion (the request's messages and the reply) to this file as "
        "OpenAI-format conversations, the format `sft.traces` trains on",
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or UserError (taken by the server, so nothing can take the
    port between this check and serving)."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {port}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:  # in use, no such interface, a privileged port
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def check_weights_store(store: Path) -> None:
    """A local --weights-store: refused when it cannot become one (a file, a missing parent folder);
    one line of warning when nothing is there yet (a run may start publishing to it later)."""
    if store.exists() and not store.is_dir():
        raise UserError(f"--weights-store {str(store)!r} is not a directory (a run's weight store)")
    if not store.parent.is_dir():
        raise UserError(f"--weights-store {str(store)!r}: directory {str(store.parent)!r} does not exist")
    if not store.exists():
        print(
            f"strop serve: --weights-store {str(store)!r} holds no versions yet: weight updates fail until a run "
            "publishes there",
            file=sys.stderr,
        )


def serve(args: argparse.Namespace, sock: socket.socket) -> None:
    """Load the checkpoint and serve it on `sock` until SIGTERM or Ctrl-C."""
    from strop.threads import set_threads

    set_threads(args.threads)
    import uvicorn

    from strop.data.chat import StropFormat
    from strop.engine.engine import Engine
    from strop.env.harness.chat_formats import chat_format
    from strop.gc_freeze import freeze_long_lived
    from strop.online.app import create_serving_app
    from strop.online.auth import KeyFile
    from strop.online.store import Store
    from strop.online.versions import Versions

    try:
        keys = KeyFile.load(args.keys) if args.keys else None
        store = Store(args.store) if args.store else None
        versions = Versions(args.weights_store) if args.weights_store else None
        engine = Engine.from_checkpoint(
            args.checkpoint,
            max_batch=args.max_batch,
            max_len=args.max_len,
            deterministic=args.deterministic,
            stale_prefixes=False,  # each reply is what its version computes: logged behaviour, rollbacks
        )
    except ValueError as e:  # e.g. --max-len past the model's limit, a bad key file, an unreachable database
        raise UserError(str(e)) from None
    chat = chat_format(engine.tokenizer, args.chat_template, args.tool_parser)
    chat = None if isinstance(chat, StropFormat) else chat  # the server's own rendering is strop's format
    name = args.name or Path(args.checkpoint).resolve().name
    engine.start()
    port = sock.getsockname()[1]
    print(
        f"strop serve: {name} on http://{args.host}:{port} (max batch {args.max_batch}, "
        f"{'deterministic' if args.deterministic else 'default'} ops, "
        f"chat in {'strop format' if chat is None else 'the template ' + chat.name}, "
        f"{f'{len(keys.keys)} API keys' if keys else 'no API keys'}, "
        f"{'completion log ' + args.store if store else 'no completion log'})",
        flush=True,
    )
    app = create_serving_app(engine, name, keys, store, versions, sessions=args.log_sessions, chat_format=chat)
    freeze_long_lived()  # the engine's loop shares the GIL with the server: a full collection stops both
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_S))
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
        if store is not None:
            store.close()


def run(args: argparse.Namespace) -> int:
    if args.max_batch < 1:
        raise UserError(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.max_len is not None and args.max_len < 2:
        raise UserError(f"--max-len must be at least 2, got {args.max_len}")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be at least 1, got {args.threads}")
    if not args.keys and not is_loopback(args.host):
        raise UserError(f"--host {args.host} is not loopback: serving beyond this machine needs --keys")
    if args.weights_store and "://" not in args.weights_store:
        check_weights_store(Path(args.weights_store))
    if args.weights_store and not args.keys:
        print(
            "strop serve: --weights-store has no effect without --keys (weight routes need an admin key)",
            file=sys.stderr,
        )
    if args.log_sessions:
        from strop.env.harness.sessions import check_log

        check_log(args.log_sessions, "--log-sessions")  # at start: not a failure on every request
    with listen(args.host, args.port) as sock:  # closed however serving ends, or fails to start
        serve(args, sock)
    return 0
