"""Scripted replies as a policy: `ScriptedClient` plays fixed assistant texts as real token ids,
and `tool_call_message` / `assistant_text` spell one assistant turn the way a policy writes it.
What every demonstrator is built from."""

from strop.data.chat import GENERATION_PROMPT, IM_END, render_message
from strop.policy_api import Generation, SamplingParams


def tool_call_message(say: str, name: str, /, **arguments) -> dict:
    """An assistant message saying `say` and calling the tool `name` with `arguments` (which may
    include a `content` argument: the two are positional only)."""
    call = {"id": "", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": say, "tool_calls": [call]}


class ScriptedClient:
    """A `PolicyClient` that plays fixed assistant texts, one per turn (then repeats the last),
    each encoded once by the tokenizer and ended with <|im_end|> when it lacks one. Its tokens
    get logprob 0.0 (demonstrations are certain) and version `version`."""

    def __init__(self, texts: list[str], tokenizer, version: int = 0):
        assert texts, "a script needs at least one turn"
        self.texts, self.tokenizer, self.version = texts, tokenizer, version
        self.next = 0

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        text = self.texts[min(self.next, len(self.texts) - 1)]
        self.next += 1
        ids = self.tokenizer.encode(text if text.endswith(IM_END) else text + IM_END, add_special_tokens=False)
        finish = "stop" if len(ids) <= params.max_tokens else "length"
        ids = ids[: params.max_tokens]
        return Generation(
            ids,
            [0.0] * len(ids),
            [self.version] * len(ids),
            self.tokenizer.decode(ids, skip_special_tokens=False),
            finish_reason=finish,
        )


def assistant_text(message: dict) -> str:
    """What a policy generates for `message`: its rendering after the generation prompt, through <|im_end|>."""
    return render_message(message)[len(GENERATION_PROMPT) : -1]
