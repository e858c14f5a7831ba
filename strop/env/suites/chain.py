"""The `chain` suite: long-horizon tasks whose last step needs facts found at the first.

A task is a repository of stage files under `stages/` (long logs, most of each line noise) and a
`solution.py` whose `answer()` is a stub. The instruction names the first stage; each stage file of
the chain holds one `STAGE i KEY: dddd-dddd` line and one `STAGE i NEXT: path` line naming the next
stage (the last says `none`); decoy files hold other keys of no stage of the chain. The agent must
follow the chain to its end and then write `answer()` returning every key in chain order, separated
by spaces: the keys found first are needed last, so an agent whose context window fills up partway
must carry them across resets (`strop.env.harness.context`). Spaces, as a summary lists keys, make writing the
answer a copy: joined by "-", the tiny policy carried all 12 keys of a chain and still garbled them
while reformatting (README, "Long context"). Difficulty is the chain's length (`STAGES`): at
difficulty 3 the whole conversation is several times a 2k-token window with the default tokenizer
(`strop bench longctx` reports the multiple it measured).

The generator knows the facts a later step needs (`metadata["facts"]`, the keys in order), so a
probe can tell how many of them a carried state lost (`strop.env.harness.context.facts_lost`). Graded by
values (`strop.env.grading.isolated`): the judge calls `solution.answer()` and checks each key at its
place; the reward is the share of checks passed, so a policy that carries some keys gets a signal. Everything
derives from `random.Random("chain/{difficulty}/{split}/{i}")`; train and eval use different seeds.
"""

from random import Random

from strop.env.task import Task
from strop.errors import UserError

SIZES = {"train": 1000, "eval": 1000}
STAGES = {1: 4, 2: 12, 3: 32}  # chain length per difficulty
DECOYS = 3  # stage-like files off the chain
NOISE_LINES = 18  # lines of each stage file that say nothing the task needs
NOISE = [
    "the build step finished",
    "cache warmed for the next run",
    "no changes since the last check",
    "retrying the upload once",
    "all workers reported in",
    "queue drained without errors",
]
WORDS = [
    "amber",
    "basil",
    "cedar",
    "delta",
    "ember",
    "fjord",
    "gamma",
    "heron",
    "indigo",
    "juniper",
    "kelp",
    "lotus",
    "maple",
    "nectar",
    "onyx",
    "pepper",
    "quartz",
    "raven",
    "sage",
    "tulip",
    "umber",
    "violet",
    "willow",
    "yarrow",
]
STUB = (
    'def answer() -> str:\n    """Every stage KEY of the chain, in chain order, separated by spaces."""\n'
    "    raise NotImplementedError\n"
)

CHECKS_MODULE = '''"""Hidden checks, run by strop's judge: the code under test only answers `call`. One check
per key at its place in the chain, and one that there are no more: every key a carried state kept
earns its share of the reward (the suite's tasks are scored "fraction"), and only all of them solve."""

EXPECTED = {expected!r}


def _keys(call):
    return str(call("solution", "answer")).split()


def _key(i):
    def check(call):
        keys = _keys(call)
        assert i < len(keys) and keys[i] == EXPECTED[i], f"key {{i}} wrong or missing"

    return check


def _count(call):
    assert len(_keys(call)) == len(EXPECTED), "wrong number of keys"


CHECKS = [(f"key {{i}}", _key(i)) for i in range(len(EXPECTED))] + [("number of keys", _count)]
'''


def _noise(rng: Random, n: int) -> list[str]:
    return [f"log {rng.randrange(100):02d}: {rng.choice(NOISE)}" for _ in range(n)]


def _stage_file(rng: Random, index: int | str, key: str, nxt: str) -> str:
    lines = _noise(rng, NOISE_LINES)
    at = sorted(rng.sample(range(len(lines) + 1), 2))
    lines.insert(at[1], f"STAGE {index} NEXT: {nxt}")
    lines.insert(at[0], f"STAGE {index} KEY: {key}")
    return "\n".join(lines) + "\n"


def make_task(difficulty: int, split: str, index: int) -> Task:
    rng = Random(f"chain/{difficulty}/{split}/{index}")
    n = STAGES[difficulty]
    names = rng.sample([f"{a}_{b}" for a in WORDS for b in WORDS if a != b], n + DECOYS)
    paths = [f"stages/{name}.txt" for name in names]
    # Digits only: the tiny policy copied a key's digits into its summaries but wrote another word of
    # WORDS in place of a key's word (`word-dddd` keys, README "Long context").
    keys = [f"{rng.randrange(10_000):04d}-{rng.randrange(10_000):04d}" for _ in range(n + DECOYS)]
    files = {"solution.py": STUB}
    for i in range(n):
        files[paths[i]] = _stage_file(rng, i, keys[i], paths[i + 1] if i + 1 < n else "none")
    for j in range(n, n + DECOYS):  # off the chain: a key no stage asks for, numbered like no stage
        files[paths[j]] = _stage_file(rng, f"X{j - n}", keys[j], "none")
    expected = " ".join(keys[:n])
    instruction = (
        f"Follow the chain of {n} stages that starts at {paths[0]}: each stage file has a line "
        f"'STAGE i KEY: ...' and a line 'STAGE i NEXT: <file>' naming the next stage. Then make answer() "
        f"in solution.py return all {n} keys in chain order separated by single spaces. Files not on the chain do "
        "not count."
    )
    return Task(
        id=f"chain-d{difficulty}-{split}-{index:04d}",
        suite="chain",
        split=split,
        instruction=instruction,
        files=files,
        hidden_tests={"tests/test_hidden.py": CHECKS_MODULE.format(expected=keys[:n])},
        grader="values",
        metadata={
            "family": "chain",
            "difficulty": difficulty,
            "facts": keys[:n],
            "chain": paths[:n],
            "n_tests": n + 1,
            "reward_mode": "fraction",
            "reference_edits": [
                {"path": "solution.py", "old": "    raise NotImplementedError\n", "new": f"    return {expected!r}\n"}
            ],
        },
    )


def load(split: str | None = None, difficulty: int | None = None, limit: int | None = None) -> list[Task]:
    """Tasks of one split (both when None) and difficulty (all when None); `limit` per (split, difficulty)."""
    if difficulty is not None and difficulty not in STAGES:
        raise UserError(f"suite chain has no difficulty {difficulty}; its difficulties are {list(STAGES)}")
    return [
        make_task(d, s, i)
        for d in ([difficulty] if difficulty else STAGES)
        for s in ([split] if split else SIZES)
        for i in range(min(SIZES[s], limit or SIZES[s]))
    ]


def get(task_id: str) -> Task | None:
    """One task by id without generating the suite; None if the id is not one of its tasks."""
    parts = task_id.split("-")
    if len(parts) != 4 or parts[0] != "chain" or parts[1] not in {f"d{d}" for d in STAGES} or not parts[3].isdigit():
        return None
    d, split, i = int(parts[1][1]), parts[2], int(parts[3])
    return make_task(d, split, i) if split in SIZES and i < SIZES[split] else None
