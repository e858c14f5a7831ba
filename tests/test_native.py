"""strop.native: C sources built once per source and CPU, cached, and skipped on request."""

import shutil

import pytest

from strop.native import load_library

SOURCE = "long add_one(long x) { return x + 1; }\n"


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
def test_builds_caches_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("STROP_NO_KERNELS", raising=False)
    assert load_library("t", SOURCE).add_one(41) == 42
    built = list((tmp_path / "strop").glob("t_*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    assert load_library("t", SOURCE).add_one(1) == 2  # from the cache: not rebuilt
    assert built[0].stat().st_mtime_ns == mtime
    assert load_library("t", SOURCE + "\n// changed\n").add_one(1) == 2  # a new source gets its own file
    assert len(list((tmp_path / "strop").glob("t_*.so"))) == 2


def test_no_kernels_and_broken_sources_give_none(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("STROP_NO_KERNELS", "1")
    assert load_library("t", SOURCE) is None
    monkeypatch.delenv("STROP_NO_KERNELS")
    assert load_library("t", "this is not C") is None
