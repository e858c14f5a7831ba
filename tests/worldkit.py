"""Fixtures of real worlds (`strop.bench.worlds`): the test image, its layers, and a git repository
with fix-and-test commits, made once per session."""

from pathlib import Path

import pytest

from strop.bench.worlds import (
    MARKER,
    base_layer,
    docker_archive,
    fix_and_test_repo,
    host_python,
    oci_layout,
    top_layer,
)
from strop.env.world.repo import git

__all__ = ["MARKER", "docker_archive", "git", "host_python", "oci_layout"]


@pytest.fixture(scope="session")
def image_layers(tmp_path_factory) -> list[Path]:
    if host_python() is None:
        pytest.skip("the test image is assembled from this machine's Debian python3, which it lacks")
    d = tmp_path_factory.mktemp("image")
    return [base_layer(d / "base.tar"), top_layer(d / "top.tar")]


@pytest.fixture(scope="session")
def test_image(image_layers, tmp_path_factory) -> str:
    """An OCI image layout of the test image (unpacked into the node cache on first use)."""
    return str(oci_layout(tmp_path_factory.mktemp("oci") / "layout", image_layers))


@pytest.fixture(scope="session")
def image_without_pytest(image_layers, tmp_path_factory) -> str:
    """The test image with no Python package beyond the standard library: a user's image that lacks
    the test runner."""
    d = tmp_path_factory.mktemp("bare")
    return str(oci_layout(d / "layout", [base_layer(d / "base.tar", packages=()), image_layers[1]]))


@pytest.fixture(scope="session")
def calc_repo(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    path = tmp_path_factory.mktemp("repos") / "calc"
    return path, fix_and_test_repo(path)


@pytest.fixture(autouse=True)
def sources_outside(tmp_path_factory, monkeypatch):
    """Autouse where imported: the session's repositories and images lie outside each test's task-file
    directory, which a task file may name only when the user allows it (`STROP_TASK_SOURCES`)."""
    monkeypatch.setenv("STROP_TASK_SOURCES", str(tmp_path_factory.getbasetemp()))
