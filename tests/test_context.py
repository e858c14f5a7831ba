"""Context strategies in the real harness and sandbox: a full window resets into system + task + the
carried state, the summary is a generated (trained) reply to the summary request, each baseline
carries what it promises, windows never overrun, and max_resets bounds the resets."""

import json
from dataclasses import replace

import pytest

from strop.data.chat import GENERATION_PROMPT, IM_END
from strop.env.demonstrators.runs import DEMONSTRATION_HARNESS
from strop.env.demonstrators.scripted import ScriptedClient
from strop.env.harness.context import COMPACTION_HEADER, MASKED, SUMMARY_HEADER, SUMMARY_REQUEST, truncate, turns
from strop.env.harness.loop import Harness
from tests.test_harness import call, check_bookkeeping, sandbox  # noqa: F401 - sandbox is a fixture over this world

FILES = [f"notes_{i}.txt" for i in range(8)]
SUMMARY = "Read notes so far; keep reading the rest, then submit."


TURNS = [f"Reading {p}." + call("read_file", path=p) for p in FILES] + ["Done." + call("submit")]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    for i, p in enumerate(FILES):
        (root / p).write_text("".join(f"note {i}.{j}: value {i * 100 + j}\n" for j in range(12)))
    return root


class SummarizingClient(ScriptedClient):
    """The scripted turns, except that a prompt ending in the summary request gets `summary`."""

    def __init__(self, texts, tokenizer, summary: str):
        super().__init__(texts, tokenizer)
        self.summary_client = ScriptedClient([summary], tokenizer, version=7)
        self.tail = f"{SUMMARY_REQUEST}{IM_END}\n{GENERATION_PROMPT}"

    def generate(self, prompt_ids, params):
        if self.tokenizer.decode(prompt_ids, skip_special_tokens=False).endswith(self.tail):
            return self.summary_client.generate(prompt_ids, params)
        return super().generate(prompt_ids, params)


def play(tok, sandbox, **config):
    config = {"max_context": 1100, "max_turn_tokens": 64, "summary_tokens": 48, "max_turns": 20, **config}
    client = SummarizingClient(TURNS, tok, SUMMARY)
    episode = Harness(tok, replace(DEMONSTRATION_HARNESS, **config)).run(
        client, sandbox, "Read every notes file, then submit."
    )
    check_bookkeeping(tok, episode)
    assert all(len(s) <= config["max_context"] for s in episode.segments)
    return episode


def test_summarize_carries_the_policys_own_summary(tiny_tokenizer, sandbox):
    episode = play(tiny_tokenizer, sandbox, context_strategy="summarize")
    assert episode.stop_reason == "submitted", episode.stop_reason
    assert len(episode.resets) >= 2 and len(episode.segments) == len(episode.resets) + 1
    summary_ids = tiny_tokenizer.encode(SUMMARY + IM_END, add_special_tokens=False)
    for closed, opened, reset in zip(episode.segments, episode.segments[1:], episode.resets):
        # the full window ends in the request and the generated summary: trained like any action
        assert closed.messages[-2]["content"] == SUMMARY_REQUEST and closed.messages[-1]["content"] == SUMMARY
        n = len(summary_ids)
        assert closed.input_ids[-n:] == summary_ids and closed.loss_mask[-n:] == [1] * n
        assert closed.versions[-n:] == [7] * n
        # the next window: system, task, summary (no tail by default)
        assert [m["role"] for m in opened.messages[:3]] == ["system", "user", "user"]
        assert opened.messages[2]["content"] == f"{SUMMARY_HEADER}\n{SUMMARY}" == reset["carried"][0]["content"]
        assert reset["carried_tokens"] > 0
    assert [c["name"] for c in episode.tool_calls] == ["read_file"] * len(FILES) + ["submit"]


def test_summary_tail_carries_recent_turns_verbatim(tiny_tokenizer, sandbox):
    episode = play(tiny_tokenizer, sandbox, context_strategy="summarize", summary_tail=1)
    carried = episode.resets[0]["carried"]
    assert carried[1]["role"] == "assistant" and carried[2]["role"] == "tool"


def test_truncation_keeps_the_latest_whole_turns(tiny_tokenizer, sandbox):
    episode = play(tiny_tokenizer, sandbox, context_strategy="truncation")
    assert episode.stop_reason == "submitted" and episode.resets
    for reset in episode.resets:
        assert reset["carried"][0]["role"] == "assistant"  # whole turns, oldest dropped
        assert SUMMARY_REQUEST not in json.dumps(episode.messages)


def test_masking_hides_old_observations(tiny_tokenizer, sandbox):
    episode = play(tiny_tokenizer, sandbox, context_strategy="masking", keep_recent=1, max_context=1300)
    assert episode.stop_reason == "submitted" and episode.resets
    tools = [m for m in episode.segments[-1].messages if m["role"] == "tool"]
    assert any(m["content"] == MASKED for m in tools) and tools[-1]["content"] != MASKED


def test_compaction_lists_every_call(tiny_tokenizer, sandbox):
    episode = play(tiny_tokenizer, sandbox, context_strategy="compaction", keep_recent=1)
    assert episode.stop_reason == "submitted" and episode.resets
    note = episode.resets[-1]["carried"][0]["content"]
    assert note.startswith(COMPACTION_HEADER) and note.count("read_file") >= 2


def test_max_resets_bounds_the_episode(tiny_tokenizer, sandbox):
    episode = play(tiny_tokenizer, sandbox, context_strategy="summarize", max_resets=1)
    assert len(episode.resets) == 1 and episode.stop_reason == "context_full"
    none = play(tiny_tokenizer, sandbox)
    assert not none.resets and none.stop_reason == "context_full" and len(none.segments) == 1


def test_truncate_keeps_whole_turns_that_fit():
    history = [
        {"role": "assistant", "content": "a" * 5},
        {"role": "tool", "content": "b" * 5},
        {"role": "assistant", "content": "c" * 3},
        {"role": "tool", "content": "d" * 3},
    ]
    count = lambda ms: sum(len(m["content"]) for m in ms)  # noqa: E731 - characters stand in for tokens
    assert len(turns(history)) == 2
    assert truncate(history, 6, count) == history[2:]
    assert truncate(history, 16, count) == history
    assert truncate(history, 5, count) == []
