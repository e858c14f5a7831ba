"""Scripted replies as a policy: `ScriptedClient` plays fixed assistant texts as real token ids,
and `tool_call_message` / `assistant_text` spell one assistant turn the way a policy writes it in the
harness's chat format (strop's, or a checkpoint's template: demonstrations then train a real model in
its own template). What every demonstrator is built from."""

from strop.data.chat import IM_END
from strop.policy_api import Generation, SamplingParams

# what a turn is rendered after to read off its text: an assistant turn of the formats strop speaks
# renders the same after any window (their append-only check plays several)
OPENING = [{"role": "system", "content": "."}, {"role": "user", "content": "."}]


def tool_call_message(say: str, name: str, /, **arguments) -> dict:
    """An assistant message saying `say` and calling the tool `name` with `arguments` (which may
    include a `content` argument: the two are positional only)."""
    call = {"id": "", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": say, "tool_calls": [call]}


class ScriptedClient:
    """A `PolicyClient` that plays fixed assistant texts, one per turn (then repeats the last),
    each encoded once by the tokenizer and ended with `end_text` (the format's end-of-turn token)
    when it lacks it. Its tokens get logprob 0.0 (demonstrations are certain) and version `version`."""

    def __init__(self, texts: list[str], tokenizer, version: int = 0, end_text: str = IM_END):
        assert texts, "a script needs at least one turn"
        self.texts, self.tokenizer, self.version, self.end_text = texts, tokenizer, version, end_text
        self.next = 0

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        text = self.texts[min(self.next, len(self.texts) - 1)]
        self.next += 1
        ended = text if text.endswith(self.end_text) else text + self.end_text
        ids = self.tokenizer.encode(ended, add_special_tokens=False)
        finish = "stop" if len(ids) <= params.max_tokens else "length"
        ids = ids[: params.max_tokens]
        return Generation(
            ids,
            [0.0] * len(ids),
            [self.version] * len(ids),
            self.tokenizer.decode(ids, skip_special_tokens=False),
            finish_reason=finish,
        )


def assistant_text(message: dict, fmt) -> str:
    """What a policy generates for `message` in the chat format `fmt`, through its end-of-turn token."""
    return fmt.assistant_text(OPENING, message, None)


def scripted_client(messages: list[dict], fmt, version: int = 0) -> ScriptedClient:
    """A `ScriptedClient` playing `messages` (assistant turns) as a policy writes them in `fmt`."""
    return ScriptedClient([assistant_text(m, fmt) for m in messages], fmt.tokenizer, version, fmt.end_text)
