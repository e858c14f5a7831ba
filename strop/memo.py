"""Naming and remembering things by what decides them: `content_key` (the name of a cached entry: a
truncated sha256 of the values that decide its content) and `by_version` (a function memoised per
version of its inputs, so a file changed on disk is read again)."""

import functools
import hashlib
import os
from typing import Callable, Hashable, TypeVar

KEY_HEX = 24  # hex digits of a key: 96 bits, far from any collision among a node's entries
T = TypeVar("T")


def content_key(*parts: str | bytes) -> str:
    """The name of the entry `parts` decide: the first KEY_HEX hex digits of their NUL-joined sha256
    (str parts as UTF-8)."""
    return hashlib.sha256(b"\0".join(p.encode() if isinstance(p, str) else p for p in parts)).hexdigest()[:KEY_HEX]


def file_version(path: str, *_) -> tuple:
    """What tells two versions of the file at `path` apart: its modification time and size."""
    st = os.stat(path)
    return (st.st_mtime_ns, st.st_size)


def by_version(version: Callable[..., Hashable] = file_version, maxsize: int = 64):
    """Memoise `fn(*args)` per (args, `version(*args)`): the same arguments with another version of
    what they name (a file rewritten, a directory edited) are computed again."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.lru_cache(maxsize)
        def cached(args: tuple, stamp: Hashable) -> T:
            return fn(*args)

        @functools.wraps(fn)
        def call(*args):  # positional only: one key per call, however it is spelt
            return cached(args, version(*args))

        return call

    return wrap
