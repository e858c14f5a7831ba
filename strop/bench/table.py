"""Printing benchmark results as an aligned text table and writing them as JSON."""

import json

from strop.outputs import check_output_file, write_atomic


def format_table(rows: list[dict], columns: list[str]) -> str:
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def write_json(path: str | None, payload: dict) -> None:
    """`payload` as indented JSON at `path` (in a directory that exists), written whole or not at all."""
    if path:
        write_atomic(check_output_file(path), json.dumps(payload, indent=2))
