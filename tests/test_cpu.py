"""Numerics pinned to AVX2 (`strop.cpu`): what the libraries are told, that a user's own setting
stands, and the opt-out. The bitwise check across instruction sets is `tests/test_numerics.py` (slow)."""

import os
import subprocess
import sys

import pytest

from strop import cpu

PROBE = "import os, strop.cpu as c; m = c.pin_numerics(); print(m, os.environ.get('MKL_CBWR'))"


def probe(env: dict) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in (*cpu.PINNED, "STROP_NUMERICS")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.mark.skipif(not cpu.pinnable(), reason="numerics are pinned on x86-64 CPUs with AVX2 and FMA only")
def test_pinned_by_default_unless_opted_out_and_a_users_setting_stands():
    assert probe({}) == ["avx2", "AVX2,STRICT"]
    assert probe({"MKL_CBWR": "COMPATIBLE"})[1] == "COMPATIBLE"
    assert probe({"STROP_NUMERICS": "native"}) == ["native", "None"]


def test_describe_names_the_cpu_and_its_numerics():
    d = cpu.describe()
    assert d["model"] and d["cores"] >= 1 and d["numerics"] in ("avx2", "native")
    line = cpu.describe_line(d)
    assert d["model"] in line and f"numerics {d['numerics']}" in line
