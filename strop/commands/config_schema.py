"""`strop config schema`: every config key with its type, default, bounds and help, as Markdown (the
docs site's configuration reference is this output) or as JSON Schema (for editors and validators).

Read from `strop.config.Config` itself, so the reference cannot drift from what `load_config` accepts.
"""

import argparse
import dataclasses
import json
import types
import typing
from typing import Any, Literal

from strop.config import Config

SECTION_INTRO = "A run config is a TOML file of these sections; `--set section.key=value` overrides one key."


@dataclasses.dataclass
class Key:
    """One config key as the reference shows it."""

    name: str  # dotted, e.g. "rl.lr"
    type: Any  # the field's annotation
    default: Any
    help: str
    bounds: dict[str, float]  # ge / le / gt, where set
    nonempty: bool
    advanced: bool


def sections(cls: type = Config, prefix: str = "") -> list[tuple[str, type]]:
    """[(dotted section name, dataclass)] in declaration order, nested sections after their parent."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.append((prefix + f.name, tp))
            out.extend(sections(tp, prefix + f.name + "."))
    return out


def keys(section: type, name: str) -> list[Key]:
    """The scalar and list keys of one section (nested sections are sections of their own)."""
    hints = typing.get_type_hints(section)
    defaults = section()
    out = []
    for f in dataclasses.fields(section):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            continue
        meta = dict(f.metadata)
        out.append(
            Key(
                name=f"{name}.{f.name}",
                type=tp,
                default=getattr(defaults, f.name),
                help=meta.get("help", ""),
                bounds={b: meta[b] for b in ("ge", "le", "gt") if meta.get(b) is not None},
                nonempty=bool(meta.get("nonempty")),
                advanced=bool(meta.get("advanced")),
            )
        )
    return out


def all_keys() -> list[Key]:
    return [k for name, cls in sections() for k in keys(cls, name)]


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " \\| ".join(json.dumps(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    if origin in (types.UnionType, typing.Union):
        return " \\| ".join("none" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    return tp.__name__


def _bounds_text(k: Key) -> str:
    words = {"ge": ">=", "le": "<=", "gt": ">"}
    parts = [f"{words[b]} {v:g}" for b, v in k.bounds.items()]
    if k.nonempty:
        parts.append("not empty")
    return ", ".join(parts)


def _default_text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v)


def markdown() -> str:
    """The configuration reference: one table per section, advanced keys in a table of their own."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `strop/config.py` (the same text as `strop config schema`); do not edit by hand.",
        SECTION_INTRO,
        "Keys marked *advanced* exist for experiments (controls, the scripted demonstrator's mixture,",
        "reward shaping for sweeps, links shaped to stand for a WAN): a user's run leaves them at their",
        "defaults. Their help says what each is for.",
        "",
    ]
    for name, cls in sections():
        ks = keys(cls, name)
        lines += [f"## [{name}]", ""]
        doc = (cls.__doc__ or "").strip()
        if doc and not doc.startswith(cls.__name__ + "("):  # dataclasses invent a signature docstring
            lines += [doc, ""]
        if not ks:
            lines += ["Holds only the sections below.", ""]
        for title, group in (("", [k for k in ks if not k.advanced]), ("Advanced", [k for k in ks if k.advanced])):
            if not group:
                continue
            if title:
                lines += [f"**{title}** (`[{name}]`):", ""]
            lines += ["| key | type | default | bounds | help |", "|---|---|---|---|---|"]
            for k in group:
                help_text = k.help.replace("|", "\\|").replace("\n", " ")
                default = _default_text(k.default)
                lines.append(f"| `{k.name}` | {type_name(k.type)} | `{default}` | {_bounds_text(k)} | {help_text} |")
            lines.append("")
    return "\n".join(lines)


def _json_type(tp: Any) -> dict:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin is list:
        return {"type": "array", "items": _json_type(typing.get_args(tp)[0])}
    if origin in (types.UnionType, typing.Union):
        return {"anyOf": [{"type": "null"} if a is type(None) else _json_type(a) for a in typing.get_args(tp)]}
    return {"type": {bool: "boolean", int: "integer", float: "number", str: "string"}[tp]}


def _json_object(cls: type, prefix: str) -> dict:
    hints = typing.get_type_hints(cls)
    props = {}
    by_name = {k.name: k for k in keys(cls, prefix.rstrip("."))}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            props[f.name] = _json_object(tp, prefix + f.name + ".")
            continue
        k = by_name[prefix + f.name]
        prop = {**_json_type(tp), "default": k.default, "description": k.help}
        names = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum"}
        prop.update({names[b]: v for b, v in k.bounds.items()})
        if k.nonempty:
            prop["minItems"] = 1
        if k.advanced:
            prop["x-strop-advanced"] = True
        props[f.name] = prop
    return {"type": "object", "additionalProperties": False, "properties": props}


def json_schema() -> dict:
    """JSON Schema (2020-12) of a run config file."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "strop run config",
        "description": SECTION_INTRO,
        **_json_object(Config, ""),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format",
        choices=["markdown", "json"],
        default="markdown",
        help="Markdown tables (the docs' configuration reference) or JSON Schema",
    )


def run(args: argparse.Namespace) -> int:
    print(markdown() if args.format == "markdown" else json.dumps(json_schema(), indent=2))
    return 0
