"""MkDocs hook: the reference pages, generated from the code at every build so they cannot drift.

    reference/config.md        every config key (`strop config schema`)
    reference/commands.md      every command's arguments (strop.cli.COMMANDS and each add_arguments)

`tests/test_docs.py` imports this file to check that every key and command is covered and has help.
"""

import argparse
import importlib

from mkdocs.structure.files import File, Files


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
        "Generated from `strop/cli.py`'s command table and each command's arguments; do not edit by hand.",
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


PAGES = {
    "reference/config.md": config_markdown,
    "reference/commands.md": commands_markdown,
}


def on_files(files: Files, config) -> Files:
    for path, render in PAGES.items():
        files.append(File.generated(config, path, content=render()))
    return files
