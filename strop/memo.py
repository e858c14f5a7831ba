"""Naming and remembering things by what decides them: `content_key` (the name of a cached entry: a
truncated sha256 of the values that decide its content) and `by_version` (a function memoised per
version of its inputs, so a file changed on disk is read again)."""

import functools
import hashlib
import os
from typing import Callable, Hashable, TypeVar

KEY_HEX = 24  # hex digits of a key: 96 bits, far from any collision among a node's entries
T = TypeVar("T")


def content_key(*parts: str) -> str:
    """The name of the entry `parts` decide: the first KEY_HEX hex digits of their NUL-joined sha256."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:KEY_HEX]


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
        def call(*args):
            return cached(args, version(*args))

        call.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        return call

    return wrap
