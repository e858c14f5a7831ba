"""The reference pages, generated from the code and committed, so that every link to them resolves
in the repository as on the site: `python docs/_hooks/reference.py` rewrites them, and
`tests/test_docs.py` fails when a committed page differs from what this makes of the code now.

    reference/config.md        every config key (`strop config schema`)
    reference/commands.md      every command's arguments (strop.cli.COMMANDS and each add_arguments)
    reference/http.md          the HTTP APIs' OpenAPI (the FastAPI apps, built around a real tiny engine)
    reference/run-directory.md the run directory's files and every metric (strop.run_files)
"""

import argparse
import importlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "reference"
BY_HAND = "do not edit by hand (`python docs/_hooks/reference.py` rewrites it)"


def _help(action: argparse.Action) -> str:
    text = (action.help or "").replace("|", "\\|")
    if "%(" in text:  # argparse's own substitutions (%(default)s, %(prog)s)
        text = text % {"default": action.default, "prog": "strop"}
    return text


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    names = ", ".join(f"`{s}`" for s in action.option_strings)
    if action.nargs == 0:
        return names
    metavar = action.metavar or (
        "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper()
    )
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    return f"{names} `{metavar}`"


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.required or action.default in (None, argparse.SUPPRESS, [], ""):
        return "required" if action.required and action.option_strings else ""
    return f"`{action.default}`"


def _parser_lines(parser: argparse.ArgumentParser, level: int) -> list[str]:
    lines = []
    rows = []
    subs = []
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        if isinstance(a, argparse._SubParsersAction):
            subs.append(a)
            continue
        rows.append(f"| {_flag(a)} | {_default(a)} | {_help(a)} |")
    if rows:
        lines += ["| argument | default | help |", "|---|---|---|", *rows, ""]
    for a in subs:
        helps = {c.dest: c.help for c in a._choices_actions}
        for name, sub in a.choices.items():
            lines += [f"{'#' * (level + 1)} {sub.prog}", "", helps.get(name) or "", ""]
            lines += _parser_lines(sub, level + 1)
    return lines


def command_parsers() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every command's parser, built exactly as `strop.cli.main` builds it."""
    from strop.cli import COMMANDS

    out = {}
    for key, (module_name, help_text) in sorted(COMMANDS.items()):
        parser = argparse.ArgumentParser(prog="strop " + " ".join(key), description=help_text)
        importlib.import_module(module_name).add_arguments(parser)
        out[key] = parser
    return out


def commands_markdown() -> str:
    lines = [
        "# Command reference",
        "",
        f"Generated from `strop/cli.py`'s command table and each command's arguments; {BY_HAND}.",
        "`strop COMMAND --help` prints the same. Config-driven commands take `--config FILE.toml` and any",
        "number of `--set key=value` ([configuration reference](config.md)). A user mistake prints one",
        "line, `strop: error: ...`, and exits with status 2.",
        "",
    ]
    for key, parser in command_parsers().items():
        lines += [f"## {parser.prog}", "", parser.description or "", ""]
        lines += _parser_lines(parser, 2)
    return "\n".join(lines)


def config_markdown() -> str:
    from strop.commands.config_schema import markdown

    return markdown()


def openapi_specs() -> dict[str, dict]:
    """The OpenAPI documents of strop's two HTTP apps, built as `strop serve` and an RL run build them,
    around a real engine on a tiny model (a tokenizer trained on one stdlib package; no request served)."""
    import json as json_module
    import tempfile
    from pathlib import Path

    from strop.config import DataSection, ModelSection
    from strop.data.corpus import load_corpus, stdlib_dir
    from strop.data.tokenizer import train_tokenizer
    from strop.engine.engine import Engine
    from strop.engine.server import create_app
    from strop.model.policy import build_model
    from strop.online.app import create_serving_app
    from strop.online.auth import KeyFile
    from strop.online.store import Store
    from strop.online.versions import Versions

    corpus = load_corpus(DataSection(stdlib=False, dirs=[str(stdlib_dir() / "json")], val_files=1))
    tokenizer = train_tokenizer(corpus.train, vocab_size=300, sample_bytes=100_000)
    section = ModelSection(
        hidden_size=16, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=16, num_experts=2, experts_per_token=1
    )
    engine = Engine(build_model(section, tokenizer, seed=0), tokenizer, max_batch=1, max_len=64)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "keys.json").write_text(json_module.dumps({"keys": []}))
        store = Store(str(Path(d) / "feedback.db"))
        serving = create_serving_app(
            engine, "MODEL", KeyFile.load(Path(d) / "keys.json"), store, Versions(str(Path(d) / "weights"))
        )
        specs = {"serve": serving.openapi(), "engine": create_app(engine, "MODEL", path_updates=True).openapi()}
        store.close()
    return specs


APPS = {
    "serve": (
        "strop serve",
        "The server users call (`strop serve --keys K --store DB --weights-store W`): the OpenAI-compatible "
        "API with token ids, logprobs and routed experts, ratings, and weight changes from the run's store "
        "only. Every route needs an API key with the route's scope (`infer`, `feedback`, `admin`; "
        "`strop serve key`) sent as `Authorization: Bearer KEY`; the weight routes exist only with "
        "`--keys` and `--weights-store`, `/v1/feedback` only with `--store`.",
    ),
    "engine": (
        "The engine server of an RL run",
        "The same engine API as an RL run's engines serve it to rollout workers, with weight updates from a "
        "path (`strop.engine.server`, `path_updates=True`); never exposed to users.",
    ),
}


def _schema_fields(spec: dict, schema: dict) -> list[str]:
    if "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    rows = []
    required = set(schema.get("required", []))
    for name, prop in schema.get("properties", {}).items():
        kind = prop.get("type") or " \\| ".join(
            p.get("type", p.get("$ref", "").rsplit("/", 1)[-1]) for p in prop.get("anyOf", [])
        )
        doc = (prop.get("description") or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{name}` | {kind} | {'yes' if name in required else ''} | {doc} |")
    return rows


def http_markdown(specs: dict[str, dict]) -> str:
    lines = [
        "# HTTP reference",
        "",
        "Generated from the FastAPI apps themselves (their OpenAPI documents, also here "
        f"as JSON: [strop serve](openapi-serve.json), [engine server](openapi-engine.json)); {BY_HAND}.",
        'Errors are JSON `{"error": {"message": ...}}` with status 400 (bad request), 401/403 (key, '
        "scope), 404, 409, 413 (too long for the context), 429 (rate limit, with `Retry-After`) or 503.",
        "",
    ]
    for name, spec in specs.items():
        title, intro = APPS[name]
        lines += [f"## {title}", "", intro, "", "| method | path | summary |", "|---|---|---|"]
        for path, ops in sorted(spec["paths"].items()):
            for method, op in ops.items():
                lines.append(f"| {method.upper()} | `{path}` | {op.get('summary', '')} |")
        lines.append("")
        for path, ops in sorted(spec["paths"].items()):
            for method, op in ops.items():
                body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
                if body:
                    lines += [f"### {method.upper()} {path} ({title})", "", "Request body:", ""]
                    lines += ["| field | type | required | description |", "|---|---|---|---|"]
                    lines += _schema_fields(spec, body) + [""]
    return "\n".join(lines)


def run_directory_markdown() -> str:
    from strop.run_files import METRICS, RUN_FILES

    lines = [
        "# Run directory and metrics",
        "",
        f"Generated from `strop/run_files.py`, which the tests hold to what real runs write; {BY_HAND}.",
        "A run's outputs live in `run.out_dir/run.name` (`runs/demo` for the demo). Each stage's "
        "`metrics.jsonl` has one JSON object a step; `[log]` sends the same rows to W&B, TensorBoard or "
        "MLflow ([Tracking experiments and rollouts](../guides/tracking.md)).",
        "",
        "## Files",
        "",
        "| path | written by | holds |",
        "|---|---|---|",
        *[f"| `{path}` | {who} | {what} |" for path, who, what in RUN_FILES],
        "",
    ]
    for stage, metrics in METRICS.items():
        lines += [f"## Metrics: {stage}", "", "| key | meaning |", "|---|---|"]
        lines += [f"| `{k}` | {v} |" for k, v in metrics.items()] + [""]
    return "\n".join(lines)


def pages() -> dict[str, str]:
    """Path under docs/reference/ -> the page's text, as the code says now."""
    import json

    out = {
        "config.md": config_markdown(),
        "commands.md": commands_markdown(),
        "run-directory.md": run_directory_markdown(),
    }
    specs = openapi_specs()
    out["http.md"] = http_markdown(specs)
    for name, spec in specs.items():
        out[f"openapi-{name}.json"] = json.dumps(spec, indent=2)
    return {name: text.rstrip("\n") + "\n" for name, text in out.items()}


if __name__ == "__main__":
    REFERENCE.mkdir(exist_ok=True)
    for name, text in pages().items():
        (REFERENCE / name).write_text(text)
        print(f"wrote {(REFERENCE / name).relative_to(REPO)}")
