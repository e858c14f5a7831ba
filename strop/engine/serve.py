"""`strop serve`: a checkpoint behind the OpenAI-compatible API (see `strop.engine.server`)."""

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="model directory (config.json, *.safetensors, tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--name", help="served model name (default: the directory name)")
    parser.add_argument("--max-batch", type=int, default=64, help="concurrent sequences (KV-cache slots)")
    parser.add_argument("--max-len", type=int, default=None, help="longest sequence (default: model limit, at most 2048)")
    parser.add_argument("--deterministic", action="store_true", help="batch-invariant ops: logprobs equal the trainer's bit for bit")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: STROP_THREADS or all cores)")


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    set_threads(args.threads)
    import uvicorn

    from strop.engine.engine import Engine
    from strop.engine.server import create_app

    engine = Engine.from_checkpoint(args.checkpoint, max_batch=args.max_batch, max_len=args.max_len,
                                    deterministic=args.deterministic)
    name = args.name or Path(args.checkpoint).resolve().name
    engine.start()
    print(f"strop serve: {name} on http://{args.host}:{args.port} (max batch {args.max_batch}, "
          f"{'deterministic' if args.deterministic else 'default'} ops)", flush=True)
    try:
        uvicorn.run(create_app(engine, name), host=args.host, port=args.port, log_level="warning")
    finally:
        engine.stop()
    return 0
