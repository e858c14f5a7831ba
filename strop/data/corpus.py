"""The code corpus: source files gathered from the standard library and configured places,
deduplicated by content, split into train and validation by file (the last files by path order
are held out, so the split never changes when a file is edited)."""

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from strop.config import DataSection
from strop.errors import UserError


@dataclass
class Document:
    name: str  # where it came from: a path relative to its root, or file.jsonl:line
    text: str


@dataclass
class Corpus:
    train: list[Document]
    val: list[Document]

    @property
    def train_bytes(self) -> int:
        return sum(len(d.text.encode()) for d in self.train)

    @property
    def val_bytes(self) -> int:
        return sum(len(d.text.encode()) for d in self.val)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _files_under(root: Path, extensions: list[str]) -> list[tuple[str, Path]]:
    if not root.is_dir():
        raise UserError(f"corpus directory {str(root)!r} does not exist")
    out = []
    for f in root.rglob("*"):
        rel = f.relative_to(root)
        if "site-packages" in rel.parts or "__pycache__" in rel.parts:
            continue
        if f.suffix in extensions and f.is_file():
            out.append((f"{root.name}/{rel.as_posix()}", f))
    return out


def _jsonl_documents(path: Path) -> list[Document]:
    if not path.is_file():
        raise UserError(f"corpus JSONL file {str(path)!r} does not exist")
    docs = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{path}:{i}: expected a JSON object with a 'text' field") from None
        docs.append(Document(f"{path.name}:{i}", text))
    return docs


def load_corpus(cfg: DataSection) -> Corpus:
    """Gather, deduplicate and split. Raises UserError if nothing usable is found."""
    named: list[tuple[str, Path]] = []
    if cfg.stdlib:
        named += _files_under(stdlib_dir(), cfg.extensions)
    for d in cfg.dirs:
        named += _files_under(Path(d).expanduser(), cfg.extensions)
    docs: list[Document] = []
    for name, f in sorted(named):
        raw = f.read_bytes()
        if 0 < len(raw) <= cfg.max_file_bytes:
            docs.append(Document(name, raw.decode("utf-8", errors="replace")))
    for j in cfg.jsonl:
        docs += _jsonl_documents(Path(j).expanduser())
    seen: set[str] = set()
    unique = []
    for doc in docs:
        h = hashlib.sha1(doc.text.encode()).hexdigest()
        if doc.text.strip() and h not in seen:
            seen.add(h)
            unique.append(doc)
    if not unique:
        raise UserError("the corpus is empty: no source files found (check data.dirs, data.jsonl, data.extensions)")
    if len(unique) <= cfg.val_files:
        raise UserError(
            f"the corpus has {len(unique)} documents, not more than data.val_files={cfg.val_files}; "
            "add data or lower it"
        )
    return Corpus(train=unique[: -cfg.val_files], val=unique[-cfg.val_files :])
