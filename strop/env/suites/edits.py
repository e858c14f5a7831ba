"""Exact search/replace edits: how reference solutions are stored (`metadata["reference_edits"]`,
a list of {"path", "old", "new"}) and turned into workspace changes."""


def reference_edit(buggy: str, fixed: str) -> tuple[str, str]:
    """The smallest whole-line (old, new) replacement turning `buggy` into `fixed`, with `old`
    unique in `buggy` (widened by context lines until it is) so a search/replace edit applies."""
    a, b = buggy.splitlines(keepends=True), fixed.splitlines(keepends=True)
    p = 0
    while p < min(len(a), len(b)) and a[p] == b[p]:
        p += 1
    s = 0
    while s < min(len(a), len(b)) - p and a[-1 - s] == b[-1 - s]:
        s += 1
    while True:
        old, new = "".join(a[p : len(a) - s]), "".join(b[p : len(b) - s])
        if old and buggy.count(old) == 1:
            return old, new
        if p > 0:
            p -= 1
        else:
            s -= 1


def apply_edits(files: dict[str, str], edits: list[dict]) -> dict[str, str]:
    """The changes (path -> new text) that exact search/replace `edits` make to `files`;
    how reference solutions (`metadata["reference_edits"]`) become workspace changes."""
    out: dict[str, str] = {}
    for e in edits:
        text = out.get(e["path"], files.get(e["path"], ""))
        assert text.count(e["old"]) == 1, f"reference edit not unique in {e['path']}"
        out[e["path"]] = text.replace(e["old"], e["new"])
    return out
