"""The parity audit probes the sandbox and the host with the same commands and lines them up."""

from pathlib import Path

from strop.env.sandbox.parity import PROBES, compare, probe_host, probe_sandbox


def test_parity_probes_both_sides(tmp_path: Path):
    inside, host = probe_sandbox(tmp_path), probe_host(tmp_path)
    assert set(inside) == set(host) == set(PROBES)
    rows = {r["probe"]: r for r in compare(inside, host)}
    assert rows["hostname"]["sandbox"] == "devbox" and rows["user"]["sandbox"] == "dev"
    assert rows["network"]["sandbox"] == "unreachable"
    assert rows["os-release"]["same"] and rows["bash"]["same"]  # the image is the host's
    assert rows["cgroup"]["sandbox"].splitlines()[0].endswith(":/")  # no host cgroup path leaks
