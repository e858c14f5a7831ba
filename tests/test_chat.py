"""The chat format: the Python renderer and the saved Jinja template agree; parsing never raises."""

from strop.data.chat import CHAT_TEMPLATE, parse_assistant, render

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
CONVERSATIONS = [
    ([{"role": "user", "content": "hi"}], None),
    ([{"role": "user", "content": "fix it"}], TOOLS),
    (
        [
            {"role": "system", "content": "You are careful."},
            {"role": "user", "content": "héllo"},
            {
                "role": "assistant",
                "content": "Looking.",
                "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}
                ],
            },
            {"role": "tool", "content": "x = 1\n"},
            {"role": "assistant", "content": "Done."},
        ],
        TOOLS,
    ),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], None),
]


def test_jinja_template_matches_python_renderer(tiny_tokenizer):
    tiny_tokenizer.chat_template = CHAT_TEMPLATE
    for messages, tools in CONVERSATIONS:
        for gen in (False, True):
            jinja = tiny_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
            assert jinja == render(messages, tools, add_generation_prompt=gen)


def test_parse_assistant_roundtrip_and_errors():
    ok = parse_assistant('Let me look.<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call>')
    assert ok.content == "Let me look." and ok.tool_calls[0].arguments == {"path": "a.py"} and not ok.errors
    for bad in [
        '<tool_call>{"name": ',
        "<tool_call>not json</tool_call>",
        "<tool_call>[1]</tool_call>",
        '<tool_call>{"name": "x", "arguments": 3}</tool_call>',
    ]:
        turn = parse_assistant(bad)
        assert turn.errors and not turn.tool_calls
    assert parse_assistant("plain answer<|im_end|>junk").content == "plain answer"
