"""`child_environment`: a spawned child sees the overrides; the parent's environment is restored."""

import multiprocessing
import os

from strop.threads import child_environment


def _report(conn) -> None:
    conn.send(os.environ.get("OMP_WAIT_POLICY"))


def test_a_spawned_child_sees_the_override_and_the_parent_keeps_its_own(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_report, args=(child,))
    with child_environment(OMP_WAIT_POLICY="PASSIVE"):
        proc.start()
    assert parent.recv() == "PASSIVE"
    proc.join(timeout=30)
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    with child_environment(OMP_WAIT_POLICY="PASSIVE"):
        pass
    assert "OMP_WAIT_POLICY" not in os.environ
