"""strop.native: C sources built once per source and CPU, cached, and skipped on request."""

import shutil

import pytest

from strop.native import load_library, read_sources

SOURCE = "long add_one(long x) { return x + 1; }\n"


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
def test_builds_caches_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("STROP_NO_KERNELS", raising=False)
    assert load_library("t", SOURCE, slow_path="python").add_one(41) == 42
    built = list((tmp_path / "strop").glob("t_*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    assert load_library("t", SOURCE, slow_path="python").add_one(1) == 2  # from the cache: not rebuilt
    assert built[0].stat().st_mtime_ns == mtime
    assert (
        load_library("t", SOURCE + "\n// changed\n", slow_path="python").add_one(1) == 2
    )  # a new source gets its own file
    assert len(list((tmp_path / "strop").glob("t_*.so"))) == 2


def test_no_kernels_and_broken_sources_give_none(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("STROP_NO_KERNELS", "1")
    assert load_library("t", SOURCE, slow_path="python") is None
    monkeypatch.delenv("STROP_NO_KERNELS")
    assert load_library("t", "this is not C", slow_path="python") is None


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
def test_a_failed_build_says_so_in_one_line_naming_the_slow_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("STROP_NO_KERNELS", raising=False)
    assert load_library("t", "this is not C", slow_path="the slow path") is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "building t failed" in err and err.rstrip().endswith("using the slow path"), err


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
def test_compiler_warnings_are_shown_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("STROP_NO_KERNELS", raising=False)
    source = "long add_one(long x) { long unused; return x + 1; }\n"
    assert load_library("t", source, slow_path="python").add_one(1) == 2
    assert "unused" in capsys.readouterr().err  # -Wall: an unused variable
    assert load_library("t", source, slow_path="python").add_one(1) == 2  # cached: built, and warned, once
    assert capsys.readouterr().err == ""


def test_shipped_sources_are_package_files_marked_by_line():
    source = read_sources("strop.sync", "delta_encode.c", "delta_decode.c")
    assert (
        source.startswith('#line 1 "strop/sync/delta_encode.c"\n') and '#line 1 "strop/sync/delta_decode.c"\n' in source
    )
    assert "delta_scan" in source and "delta_decode" in source


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
def test_strop_march_builds_for_another_cpu_in_its_own_cache_file(tmp_path, monkeypatch):
    from strop.cpu import describe

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("STROP_NO_KERNELS", raising=False)
    monkeypatch.delenv("STROP_MARCH", raising=False)
    assert load_library("t", SOURCE, slow_path="python").add_one(1) == 2
    assert describe()["kernels"] == "native"
    monkeypatch.setenv("STROP_MARCH", "x86-64-v3")  # what an AVX2 machine builds
    assert load_library("t", SOURCE, slow_path="python").add_one(1) == 2
    assert len(list((tmp_path / "strop").glob("t_*.so"))) == 2  # never the native build's file
    assert describe()["kernels"] == "x86-64-v3"
