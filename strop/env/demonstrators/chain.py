"""The demonstrator of the `chain` suite (`strop.env.suites.chain`): a `PolicyClient` that decides
every reply from the context window it is shown, so it knows only what the window carries.

Each call it reads the window's text for the chain's facts (`STAGE i KEY: ...` and `STAGE i NEXT: ...`
lines of tool outputs, or its own summary's `KEYS_LINE`, `Keys from stage j on: ' 6804-4208 ...'`,
spelled as its answer spells them: `spelled`), then:
- asked for a summary (the window ends in `strop.env.harness.context.SUMMARY_REQUEST`): it writes the keys
  of stages 0, 1, ... it can see, in order on one line, and the latest NEXT pointer in the files'
  spelling, so it can read them back;
- otherwise it reads the first stage whose key it does not see: the first stage named by the
  instruction, or the stage the previous one's NEXT names; when that pointer is gone too, it starts
  over from the first stage (which can only succeed if the window holds the whole chain);
- with every key in view it writes `solution.py` (an idempotent `write_file`), then submits; a
  summary written after that write says so (`WRITTEN_SAY`), so a reset between the two does not
  send it back to writing.

So its solve rate under a context strategy measures how much of what it found the strategy carried:
with its own summaries ("summarize") it solves every chain; the baselines drop keys it needs.

A careless demonstrator (`careful=False`, drawn with probability 1 - `sft.careful` for SFT data)
summarizes as a recency-biased compaction does: only the keys of the last `RECENT_KEYS` stages it
knows (`Keys from stage j on: ' ...'`). It then goes on from there and at the chain's end writes the
keys it still has, so it submits a wrong answer. A policy cloned from a mix of the two chooses
between them once per episode, at the first summary with more keys than that (later windows show
which summary it wrote): the choice RL has to learn, as the careless edit is for the demo's suite. Its
notes live only in its context (it never writes them to the workspace), as the task intends.
Replies are real token ids (`ScriptedClient` encodes them), so its episodes are SFT data with
summaries in them.
"""

import itertools
import re
from collections.abc import Iterable

from strop.data.chat import GENERATION_PROMPT, IM_END
from strop.env.demonstrators.scripted import ScriptedClient, assistant_text, tool_call_message
from strop.env.harness.context import SUMMARY_REQUEST
from strop.env.task import Task
from strop.policy_api import Generation, SamplingParams

KEY = re.compile(r"STAGE (\d+) KEY: (\d{4}-\d{4})")
NEXT = re.compile(r"STAGE (\d+) NEXT: (stages/[a-z_]+\.txt|none)")
KEYS_LINE = re.compile(r"Keys from stage (\d+) on: '((?: \d{4}-\d{4})+)'")
RECENT_KEYS = 4  # what a careless summary keeps
WRITE_SAY = "All keys found; writing solution.py."
SUBMIT_SAY = "Done."
WRITTEN_SAY = "Left: submit (solution.py is written)."
WROTE_SOLUTION = "wrote solution.py"  # the write_file tool's output for it (strop.env.harness.tools)
ASKED_TO_SUMMARIZE = f"{SUMMARY_REQUEST}{IM_END}\n{GENERATION_PROMPT}"


def summary(n: int, keys: dict[int, str], nexts: dict[int, str], written: bool = False, careful: bool = True) -> str:
    """What the demonstrator carries: the keys of stages 0, 1, ... up to the first it does not see
    (careless: of the last `RECENT_KEYS` stages it knows), where to go on, and what is left
    (`written`: solution.py already holds the answer)."""
    found = list(itertools.takewhile(lambda i: i in keys, range(first_kept(keys, careful), n)))
    if not careful:
        found = found[-RECENT_KEYS:]
    start = found[0] if found else 0
    lines = [f"Chain of {n} stages.", f"Keys from stage {start} on: {spelled(keys[i] for i in found)}"]
    if nexts:
        last = max(nexts)
        lines.append(f"STAGE {last} NEXT: {nexts[last]}")
    lines.append(WRITTEN_SAY if written else "Left: follow NEXT to the last stage, then write solution.py and submit.")
    return "\n".join(lines)


def spelled(keys: Iterable[str]) -> str:
    """Keys as both the summary and the answer write them: `' 6804-4208 1512-7750'`. Each key after a
    space, as in the stage file's `KEY: 6804-4208`, because the tokenizer spells digits differently
    after a space (`' 6'`) and after a quote (`'6'`): so spelled, every copy of a key, stage file to
    summary to summary to answer, is the same tokens after the same token (README, "Long context";
    `answer()`'s checks split on whitespace)."""
    return repr("".join(f" {k}" for k in keys))


def first_kept(keys: dict[int, str], careful: bool) -> int:
    """The first stage whose key the demonstrator means to have: 0, or for a careless one the first
    its window still shows (it goes on from what its summary kept)."""
    return 0 if careful else min(keys, default=0)


def next_message(task: Task, window: str, keys: dict[int, str], nexts: dict[int, str], careful: bool = True) -> dict:
    """The demonstrator's next turn given the facts it sees (see the module docstring)."""
    n, first = len(task.metadata["facts"]), task.metadata["chain"][0]
    last_turn = window.rsplit(GENERATION_PROMPT, 2)[-2] if window.count(GENERATION_PROMPT) >= 2 else ""
    if last_turn.startswith(WRITE_SAY) or WRITTEN_SAY in window:
        return tool_call_message(SUBMIT_SAY, "submit")
    wanted = range(first_kept(keys, careful), n)
    missing = [i for i in wanted if i not in keys]
    if not missing:
        body = spelled(keys[i] for i in wanted)
        return tool_call_message(
            WRITE_SAY, "write_file", path="solution.py", content=f"def answer() -> str:\n    return {body}\n"
        )
    i = missing[0]
    path = first if i == 0 else nexts.get(i - 1, first)
    return tool_call_message(f"Reading stage {i if path != first else 0}: {path}.", "read_file", path=path)


class ChainDemonstrator:
    """A `PolicyClient` for one chain task in the harness's chat format `fmt` (a ChatML one: the
    window is read by its generation prompt), tokens with logprob 0.0 and version `version`;
    `careful=False` writes careless summaries (see the module docstring)."""

    def __init__(self, task: Task, fmt, version: int = 0, careful: bool = True):
        assert task.suite == "chain", f"{task.id} is not a chain task"
        self.task, self.fmt, self.version, self.careful = task, fmt, version, careful

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        window = self.fmt.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        keys = {i: k for start, line in KEYS_LINE.findall(window) for i, k in enumerate(line.split(), int(start))}
        keys.update({int(i): k for i, k in KEY.findall(window)})
        nexts = {int(i): p for i, p in NEXT.findall(window)}
        if window.endswith(ASKED_TO_SUMMARIZE):
            written = WRITTEN_SAY in window or WROTE_SOLUTION in window
            text = summary(len(self.task.metadata["facts"]), keys, nexts, written, self.careful)
        else:
            text = assistant_text(next_message(self.task, window, keys, nexts, self.careful), self.fmt)
        client = ScriptedClient([text], self.fmt.tokenizer, self.version, self.fmt.end_text)
        return client.generate(prompt_ids, params)
