"""The docs are tested like code.

- Every config key and every command argument has help text, and the generated reference pages
  (docs/_hooks/reference.py, committed under docs/reference/) list every one and are current.
- Every link in README.md and docs/ leads to a file of the repository (not one a build makes), and
  to a heading of it where the link names one.
- The guides' commands run exactly as written: each page's ```bash blocks, in order, in one bash
  session (`set -euo pipefail`) in a fresh directory where `examples/` is the repository's and
  `strop` is on PATH. Blocks run in the fast suite unless the line before the fence says otherwise
  (docs/contributing-docs.md):

      <!-- docs-test: slow -->          only in the slow suite (`make test-slow`)
      <!-- docs-test: skip REASON -->   never run (needs a GPU, a cluster address, a browser)
      <!-- docs-test: file PATH -->     the next block (any language) is written to PATH first

  A page's fast test runs its fast blocks; its slow test runs every block that is not skipped.
- The README stays a few screens.
"""

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
FAST_PAGE_S = 120  # a page's fast blocks together; anything longer is marked slow
SLOW_PAGE_S = 3600


def _hook(name: str = "reference"):
    spec = importlib.util.spec_from_file_location(f"docs_{name}_hook", DOCS / "_hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_package_map_names_every_module_as_its_docstring_says():
    """docs/concepts/package-map.md is what docs/_hooks/package_map.py makes of the code now: a
    module added, moved or removed (or a docstring changed) without regenerating it fails here."""
    hook = _hook("package_map")
    page = hook.PAGE.read_text()
    modules = {p.relative_to(REPO / "strop").as_posix() for p in (REPO / "strop").rglob("*.py")}
    listed = {pkg.strip("`").removeprefix("strop/") + name for pkg, name in _rows(page)}
    missing = sorted(m for m in modules if not m.endswith("__init__.py") and m not in listed)
    assert missing == [], f"modules missing from the package map (run python docs/_hooks/package_map.py): {missing}"
    assert page == hook.package_map(), "the package map is stale: run python docs/_hooks/package_map.py"


def _rows(page: str) -> list[tuple[str, str]]:
    """(package heading, module file name) of every row of the package map."""
    rows, package = [], ""
    for line in page.splitlines():
        if line.startswith("## "):
            package = line[3:].strip()
        elif line.startswith("| `") and line.count("`") >= 2:
            rows.append((package, line.split("`")[1]))
    return rows


# ---- references -------------------------------------------------------------------------------


def test_every_config_key_has_help_and_is_in_the_reference():
    from strop.commands.config_schema import all_keys, json_schema, markdown

    keys = all_keys()
    assert len(keys) > 100  # the scan reads the whole Config tree
    missing = [k.name for k in keys if not k.help.strip()]
    assert missing == [], f"config keys without help text (strop/config.py opt(..., help)): {missing}"
    page = markdown()
    assert [k.name for k in keys if f"| `{k.name}` |" not in page] == []
    # the JSON Schema holds the same keys
    schema = json_schema()
    for k in keys:
        node = schema
        for part in k.name.split("."):
            node = node["properties"][part]
        assert node["description"] == k.help


def test_the_committed_reference_is_what_the_code_says():
    hook = _hook()
    stale = [n for n, text in hook.pages().items() if not (p := hook.REFERENCE / n).is_file() or p.read_text() != text]
    assert stale == [], f"stale reference pages (run python docs/_hooks/reference.py): {stale}"


LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|^ {0,3}\[[^\]]+\]:\s*(\S+)", re.M)


def _slug(heading: str) -> str:
    """A heading's anchor as Python-Markdown's toc makes it (what mkdocs links to)."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text)).strip("-")


def _repository_files() -> set[str]:
    """Files a clone of the repository has: tracked, or new and not ignored (build outputs are)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, text=True
    )
    if out.returncode != 0:
        pytest.skip("not a git checkout: which files a clone has is unknown")
    return set(out.stdout.splitlines())


def test_every_link_in_the_readme_and_docs_leads_to_a_file_of_the_repository():
    files = _repository_files()
    broken = []
    for page in [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = re.sub(r"`[^`\n]+`", "", FENCE.sub("", page.read_text()))  # links shown as code are not links
        for m in LINK.finditer(text):
            target = m.group(1) or m.group(2)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # a URL: not the repository's
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            rel = file.relative_to(REPO).as_posix() if file.is_relative_to(REPO) else str(file)
            where = f"{page.relative_to(REPO)}: {target}"
            if rel not in files and not any(f.startswith(rel + "/") for f in files):
                broken.append(f"{where} (no such file in the repository)")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+\s+(.*?)\s*$", FENCE.sub("", file.read_text()), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{where} (no such heading)")
    assert broken == [], "links that lead nowhere in a clone:\n" + "\n".join(broken)


def _arguments(parser: argparse.ArgumentParser, prog: str):
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        if isinstance(a, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in a._choices_actions}
            for name, sub in a.choices.items():
                yield f"{prog} {name}", None, helps.get(name)
                yield from _arguments(sub, f"{prog} {name}")
            continue
        yield prog, a, a.help


def test_every_command_and_argument_has_help_and_is_in_the_reference():
    from strop.cli import COMMANDS

    hook = _hook()
    parsers = hook.command_parsers()
    assert set(parsers) == set(COMMANDS)
    missing = []
    for key, parser in parsers.items():
        if not parser.description:
            missing.append(parser.prog)
        for prog, action, text in _arguments(parser, parser.prog):
            if not (text or "").strip():
                missing.append(f"{prog} {'/'.join(action.option_strings) or action.dest}" if action else prog)
    assert missing == [], "commands or arguments without help text:\n" + "\n".join(missing)
    page = hook.commands_markdown()
    assert [p.prog for p in parsers.values() if f"## {p.prog}\n" not in page] == []


def test_config_schema_command_prints_both_formats(capsys):
    import json

    from strop.cli import main

    assert main(["config", "schema"]) == 0
    assert "| `rl.lr` |" in capsys.readouterr().out
    assert main(["config", "schema", "--format", "json"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["properties"]["rl"]["properties"]["lr"]["exclusiveMinimum"] == 0


def test_shipped_configs_use_only_keys_the_schema_knows():
    import tomllib

    from strop.commands.config_schema import json_schema

    def walk(data: dict, node: dict, where: str) -> None:
        for k, v in data.items():
            assert k in node["properties"], f"{where}{k} is not in the schema"
            if isinstance(v, dict):
                walk(v, node["properties"][k], f"{where}{k}.")

    for path in sorted((REPO / "examples").glob("*.toml")):
        walk(tomllib.loads(path.read_text()), json_schema(), f"{path.name}: ")


def test_readme_is_a_few_screens():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; the record and the guides live in docs/"


# ---- the guides' commands ---------------------------------------------------------------------

MARK = re.compile(r"<!--\s*docs-test:\s*(slow|skip|file)\b\s*(.*?)\s*-->")
FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)[^\n]*\n(.*?)^\1\s*$", re.S | re.M)


@dataclass
class Block:
    page: str
    line: int
    lang: str
    text: str
    mark: str  # "", "slow", "skip" or "file"
    arg: str  # the path of a "file" block, the reason of a "skip"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a page with the docs-test mark on the line before each (if any)."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.fullmatch(before.strip())
        out.append(
            Block(
                str(path.relative_to(DOCS)),
                text[: m.start()].count("\n") + 1,
                m.group(2),
                m.group(3),
                mark.group(1) if mark else "",
                mark.group(2) if mark else "",
            )
        )
    return out


def pages_with_commands() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if any(b.lang == "bash" for b in blocks(p)))


def script(page: Path, slow: bool) -> str:
    parts = ["set -euo pipefail"]
    for b in blocks(page):
        if b.mark == "file":
            target = b.arg
            parts.append(
                f"mkdir -p \"$(dirname '{target}')\" && cat > '{target}' <<'DOCS_TEST_EOF'\n{b.text}DOCS_TEST_EOF"
            )
        elif b.lang == "bash" and b.mark != "skip" and (slow or b.mark != "slow"):
            parts.append(f"echo '--- {b.page}:{b.line}' >&2\n{b.text}")
    return "\n".join(parts) + "\n"


def run_page(page: Path, slow: bool, tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(REPO / "examples")
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "STROP_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "STROP_REPO": str(REPO),
    }
    proc = subprocess.run(
        ["bash", "-c", script(page, slow)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=SLOW_PAGE_S if slow else FAST_PAGE_S,
    )
    assert proc.returncode == 0, f"{page.relative_to(DOCS)} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"


def _params(pages: list[Path]) -> list:
    """One test per page; a page that starts Ray runs in the one test worker that runs Ray's tests."""
    ray = pytest.mark.xdist_group("ray")
    return [pytest.param(p, id=str(p.relative_to(DOCS)), marks=[ray] if "ray" in p.name else []) for p in pages]


FAST_PAGES = [p for p in pages_with_commands() if any(b.lang == "bash" and not b.mark for b in blocks(p))]
SLOW_PAGES = [p for p in pages_with_commands() if any(b.lang == "bash" and b.mark == "slow" for b in blocks(p))]


def test_every_block_mark_is_known_and_placed():
    for page in sorted(DOCS.rglob("*.md")):
        text = re.sub(r"`[^`\n]+`", "", FENCE.sub("", page.read_text()))  # marks quoted as examples do not count
        marks = len(MARK.findall(text))
        placed = sum(bool(b.mark) for b in blocks(page))
        assert marks == placed, f"{page.relative_to(DOCS)}: a docs-test mark not right above a fence"
        assert "docs-test:" not in MARK.sub("", text), f"{page.relative_to(DOCS)}: unknown docs-test mark"
        for b in blocks(page):
            assert b.mark != "skip" or b.arg, f"{b.page}:{b.line}: a skipped block says why"


@pytest.mark.parametrize("page", _params(FAST_PAGES))
def test_guide_commands_run_as_written(page, tmp_path):
    run_page(page, slow=False, tmp_path=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("page", _params(SLOW_PAGES))
def test_guide_long_commands_run_as_written(page, tmp_path):
    run_page(page, slow=True, tmp_path=tmp_path)
