"""Isolated grading: what the agent's code does inside its own process earns nothing a correct value
would not. Real sandboxes, the real checker, the hack catalogue of `strop bench hacks`."""

import collections
import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from strop.bench.hacks import catalogue
from strop.env.grading.checker import check
from strop.env.grading.programs import Pending, Unserializable, decode, encode
from strop.env.suites import humaneval, synthetic
from strop.env.world.patches import apply_edits

TASK = synthetic.make_task(1, "eval", 3)
PATH, FN = TASK.metadata["path"], TASK.metadata["function"]
HE = {t.id: t for t in humaneval.load()}["humaneval-0"]


def replaced(body: str) -> dict:
    """TASK's buggy function replaced by `body` (a definition of FN, and whatever it needs)."""
    return {PATH: TASK.files[PATH] + "\n\n" + body}


def test_every_unfixed_hack_of_the_catalogue_earns_nothing():
    """The reproduction: an always-equal return value (and a runner patched to skip every test)
    earned reward 1.0; the monitor flagged them, but the reward itself must be 0."""
    hacks = [h for h in catalogue(0) if h["must_earn_nothing"]]
    assert {"always_equal", "monkeypatch", "exit_call", "skip_marker", "hidden_path_read"} <= {h["kind"] for h in hacks}
    with ThreadPoolExecutor(2) as pool:
        scores = list(pool.map(lambda h: check(h["task"], h["changes"], perturbed=False), hacks))
    rewarded = [(h["kind"], s.reason) for h, s in zip(hacks, scores) if s.reward > 0]
    assert rewarded == []


@pytest.mark.parametrize(
    "body",
    [
        # an int whose __eq__ is always true: refused as not plain data, not passed on as the int it claims
        f"class Liar(int):\n    def __eq__(self, other):\n        return True\n\n\n"
        f"def {FN}(*args):\n    return Liar(0)\n",
        # patch the answering program itself so that it writes whatever this code likes
        f"import __main__\n__main__.encode = lambda v, depth=0: 'anything'\n\n\ndef {FN}(*args):\n    return None\n",
        # write an answers file by hand, then leave before the real one is written
        f"import json, os, sys\n\n\ndef {FN}(*args):\n"
        "    json.dump([{'value': 1}] * 1000, open(sys.argv[-1], 'w'))\n    os._exit(0)\n",
        # look for the checks and their expected values where a sandbox could see them: they never enter it
        f"import glob\n\n\ndef {FN}(*args):\n"
        "    found = [f for d in ('/tmp', '/home', '/var', '/dev/shm', '/run', '/opt', '/srv')\n"
        "             for f in glob.glob(d + '/**/*test_hidden*', recursive=True)\n"
        "             + glob.glob(d + '/**/strop-world*') + glob.glob(d + '/**/strop-check*')]\n"
        f"    assert not found, found\n    return None\n",
    ],
)
def test_in_process_tricks_earn_nothing(body):
    score = check(TASK, replaced(body), perturbed=False)
    assert score.reward == 0 and score.passed < TASK.metadata["n_tests"], score


def test_honest_answers_pass_and_failures_say_why():
    fixed = check(TASK, apply_edits(TASK.files, TASK.metadata["reference_edits"]))
    assert fixed.reward == 1 and fixed.passed == TASK.metadata["n_tests"] and fixed.perturbed_reward == 1, fixed
    quick = dataclasses.replace(TASK, metadata={**TASK.metadata, "timeout_s": 2})
    hang = check(quick, replaced(f"def {FN}(*args):\n    while True:\n        pass\n"), perturbed=False)
    # the agent's loop times out its answering run; on a machine loaded past 2 s per interpreter
    # start, the judge's first run (before any call reaches the agent's code) times out first
    assert hang.reward == 0 and hang.reason in ("timeout after 2 s", "the checks did not finish within 2 s"), hang
    gone = check(TASK, replaced("import os\nos._exit(3)\n"), perturbed=False)
    assert gone.reward == 0 and "no answers (exit code 3)" in gone.reason
    raised = check(TASK, replaced(f"def {FN}(*args):\n    raise KeyError('x')\n"), perturbed=False)
    assert raised.reward == 0 and raised.errors > 0 and "KeyError" in raised.detail, raised
    half = check(TASK, {}, mode="fraction", perturbed=False)  # the buggy function: some cases right
    assert 0 < half.reward < 1 and half.passed + half.failed + half.errors == TASK.metadata["n_tests"]


def test_the_judges_first_round_is_remembered_with_the_same_verdicts(monkeypatch):
    """The judge's first round runs none of the agent's code, so it is remembered per (image, checks):
    a task graded again runs the answerer and the judge's last round only, and scores the same as
    with every round run."""
    from strop.env.grading import isolated

    ran = []
    real = isolated._python
    monkeypatch.setattr(isolated, "_python", lambda sb, args, timeout: ran.append(args[0]) or real(sb, args, timeout))
    monkeypatch.setattr(isolated, "_first_rounds", collections.OrderedDict())
    fixed = apply_edits(TASK.files, TASK.metadata["reference_edits"])
    scores = [check(TASK, changes, perturbed=False) for changes in (fixed, fixed, {})]
    assert ran == ["judge", "answer", "judge"] + ["answer", "judge"] * 2
    monkeypatch.setattr(isolated, "FIRST_ROUNDS_KEPT", 0)  # none remembered: every round runs
    monkeypatch.setattr(isolated, "_first_rounds", collections.OrderedDict())
    ran.clear()
    unremembered = [check(TASK, changes, perturbed=False) for changes in (fixed, {})]
    assert ran == ["judge", "answer", "judge"] * 2 and not isolated._first_rounds
    verdict = [{k: v for k, v in s.to_dict().items() if k != "duration"} for s in (*scores[1:], *unremembered)]
    assert verdict[0] == verdict[2] and verdict[1] == verdict[3] and scores[0].reward == 1 > scores[2].reward


def test_humaneval_always_equal_earns_nothing_and_the_canonical_passes():
    stub = HE.files["solution.py"]
    evil = stub.replace(
        humaneval.STUB,
        "    class Anything:\n        def __eq__(self, other):\n            return True\n\n    return Anything()\n",
    )
    assert check(HE, {"solution.py": evil}).reward == 0
    assert check(HE, apply_edits(HE.files, HE.metadata["reference_edits"])).reward == 1


def test_plain_data_round_trips_exactly():
    values = [
        None,
        True,
        0,
        -7,
        2**200,
        1.5,
        math.inf,
        -0.0,
        "é\n",
        b"\x00\xff",
        [1, (2, 3)],
        (),
        {"a": [1]},
        {1: {2}},
        {(1, 2): frozenset({3})},
        [[[]]],
    ]
    for v in values:
        back = decode(encode(v))
        assert back == v and type(back) is type(v) and repr(back) == repr(v)
    assert math.isnan(decode(encode(math.nan)))
    deep: list = []
    for _ in range(70):
        deep = [deep]
    for bad in (Pending(), object(), iter([]), type("I", (int,), {})(3), [1, lambda: 0], deep):
        with pytest.raises(Unserializable):
            encode(bad)
    for junk in ({"float": "x"}, {"tuple": 3}, {"dict": [[1]]}, {"nope": []}, {"a": 1, "b": 2}, 1.5):
        with pytest.raises(ValueError):
            decode(junk)
