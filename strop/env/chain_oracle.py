"""The demonstrator of the `chain` suite (`strop.env.suites.chain`): a `PolicyClient` that decides
every reply from the context window it is shown, so it knows only what the window carries.

Each call it reads the window's text for the chain's facts (`STAGE i KEY: ...` and `STAGE i NEXT: ...`
lines of tool outputs, or its own summary's `KEYS_SAY` line), then:
- asked for a summary (the window ends in `strop.env.context.SUMMARY_REQUEST`): it writes the keys
  of stages 0, 1, ... it can see, in order on one line, and the latest NEXT pointer in the files'
  spelling, so it can read them back;
- otherwise it reads the first stage whose key it does not see: the first stage named by the
  instruction, or the stage the previous one's NEXT names; when that pointer is gone too, it starts
  over from the first stage (which can only succeed if the window holds the whole chain);
- with every key in view it writes `solution.py` (an idempotent `write_file`), then submits; a
  summary written after that write says so (`WRITTEN_SAY`), so a reset between the two does not
  send it back to writing.

So its solve rate under a context strategy measures how much of what it found the strategy carried:
with its own summaries ("summarize") it solves every chain; the baselines drop keys it needs. Its
notes live only in its context (it never writes them to the workspace), as the task intends.
Replies are real token ids (`ScriptedClient` encodes them), so its episodes are SFT data with
summaries in them.
"""

import itertools
import re

from strop.data.chat import GENERATION_PROMPT, IM_END
from strop.env.context import SUMMARY_REQUEST
from strop.env.oracle import ScriptedClient, assistant_text
from strop.env.task import Task
from strop.policy_api import Generation, SamplingParams

KEY = re.compile(r"STAGE (\d+) KEY: (\d{4}-\d{4})")
NEXT = re.compile(r"STAGE (\d+) NEXT: (stages/[a-z_]+\.txt|none)")
KEYS_SAY = "Keys from stage 0 on:"
KEYS_LINE = re.compile(re.escape(KEYS_SAY) + r"((?: \d{4}-\d{4})+)")
WRITE_SAY = "All keys found; writing solution.py."
SUBMIT_SAY = "Done."
WRITTEN_SAY = "Left: submit (solution.py is written)."
WROTE_SOLUTION = "wrote solution.py"  # the write_file tool's output for it (strop.env.tools)
ASKED_TO_SUMMARIZE = f"{SUMMARY_REQUEST}{IM_END}\n{GENERATION_PROMPT}"


def _call(say: str, name: str, **arguments) -> dict:
    call = {"id": "", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": say, "tool_calls": [call]}


def summary(n: int, keys: dict[int, str], nexts: dict[int, str], written: bool = False) -> str:
    """What the demonstrator carries: the keys of stages 0, 1, ... up to the first it does not see,
    where to go on, and what is left (`written`: solution.py already holds the answer)."""
    found = list(itertools.takewhile(lambda i: i in keys, range(n)))
    lines = [f"Chain of {n} stages.", " ".join([KEYS_SAY, *(keys[i] for i in found)])]
    if nexts:
        last = max(nexts)
        lines.append(f"STAGE {last} NEXT: {nexts[last]}")
    lines.append(WRITTEN_SAY if written else "Left: follow NEXT to the last stage, then write solution.py and submit.")
    return "\n".join(lines)


def next_message(task: Task, window: str, keys: dict[int, str], nexts: dict[int, str]) -> dict:
    """The demonstrator's next turn given the facts it sees (see the module docstring)."""
    n, first = len(task.metadata["facts"]), task.metadata["chain"][0]
    last_turn = window.rsplit(GENERATION_PROMPT, 2)[-2] if window.count(GENERATION_PROMPT) >= 2 else ""
    if last_turn.startswith(WRITE_SAY) or WRITTEN_SAY in window:
        return _call(SUBMIT_SAY, "submit")
    missing = [i for i in range(n) if i not in keys]
    if not missing:
        body = " ".join(keys[i] for i in range(n))
        return _call(
            WRITE_SAY, "write_file", path="solution.py", content=f"def answer() -> str:\n    return {body!r}\n"
        )
    i = missing[0]
    path = first if i == 0 else nexts.get(i - 1, first)
    return _call(f"Reading stage {i if path != first else 0}: {path}.", "read_file", path=path)


class ChainDemonstrator:
    """A `PolicyClient` for one chain task (tokens with logprob 0.0 and version `version`)."""

    def __init__(self, task: Task, tokenizer, version: int = 0):
        assert task.suite == "chain", f"{task.id} is not a chain task"
        self.task, self.tokenizer, self.version = task, tokenizer, version

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        window = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        keys = {i: k for line in KEYS_LINE.findall(window) for i, k in enumerate(line.split())}
        keys.update({int(i): k for i, k in KEY.findall(window)})
        nexts = {int(i): p for i, p in NEXT.findall(window)}
        if window.endswith(ASKED_TO_SUMMARIZE):
            written = WRITTEN_SAY in window or WROTE_SOLUTION in window
            text = summary(len(self.task.metadata["facts"]), keys, nexts, written)
        else:
            text = assistant_text(next_message(self.task, window, keys, nexts))
        return ScriptedClient([text], self.tokenizer, self.version).generate(prompt_ids, params)
