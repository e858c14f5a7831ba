"""`strop online rollback --to V`: every serving engine back to version V of the run's weight store
(bit for bit), recorded in the feedback store's deployments; later cycles train from V.
The admin key comes from $STROP_API_KEY."""

import argparse
import json

from strop.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--to", type=int, required=True, help="the version to serve again")
    parser.add_argument("--store", required=True, help="feedback store (SQLite path or postgresql:// URL)")
    parser.add_argument("--weights-store", required=True, help="the run's weight store the engines load from")
    parser.add_argument("--engine", action="append", required=True, help="a serving engine's URL (repeatable)")
    parser.add_argument("--checkpoint", required=True, help="the base policy directory (architecture, tokenizer)")
    parser.add_argument("--run-dir", default="runs/online", help="where trainer states and version directories live")


def run(args: argparse.Namespace) -> int:
    from strop.commands.online import open_store, settings_from
    from strop.online.cycle import rollback

    store = open_store(args.store)
    try:
        report = rollback(settings_from(args), store, args.to)
    except ValueError as e:
        raise UserError(str(e)) from None
    finally:
        store.close()
    print(json.dumps({k: report[k] for k in ("from", "to", "engines")}))
    return 0
