"""Write `sessions.jsonl`: logged sessions of a scripted agent on the toy suite's train tasks, played by
strop's production harness in real sandboxes with the example's tools and prompt, and logged as
`strop agent --log-session` logs a session (`strop.env.harness.sessions`). They are the warm-start data of
the example's SFT stage (`sft.traces` in config.toml), standing in for a product's own logs.

    python examples/toy_env/make_sessions.py     # from the repository root, with strop-toy-env installed
"""

import json
from pathlib import Path

from strop.config import DataSection, load_config
from strop.data.corpus import load_corpus
from strop.data.tokenizer import train_tokenizer
from strop.env.demonstrators.scripted import ScriptedClient
from strop.env.harness.loop import Harness, harness_config, run_task
from strop.env.harness.sessions import append_conversations, episode_conversations
from strop.env.tasks.suites import load_suite

HERE = Path(__file__).parent


def call(say: str, name: str, **arguments) -> str:
    return say + "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def script(task) -> list[str]:
    (edit,) = task.metadata["reference_edits"]
    path, fn = task.metadata["path"], task.metadata["function"]
    return [
        call("Let me see the functions.", "outline"),
        call(f"I'll read `{fn}`.", "read_file", path=path),
        call(f"The bug is in `{fn}`.", "edit_file", path=path, old=edit["old"], new=edit["new"]),
        call("Now the tests.", "run", command="python -m pytest -q"),
        call("Done.", "submit"),
    ]


def main() -> None:
    cfg = load_config(HERE / "config.toml")
    # strop's format only counts tokens here: the sessions are text, rendered again by whoever trains on them
    tokenizer = train_tokenizer(load_corpus(DataSection(val_files=5)).train[:200], 512, 400_000)
    harness = Harness(tokenizer, harness_config(cfg.rollout, cfg.harness))
    out = HERE / "sessions.jsonl"
    out.unlink(missing_ok=True)
    for task in load_suite("toy", "train"):
        episode, _ = run_task(harness, ScriptedClient(script(task), tokenizer), task)
        assert episode.stop_reason == "submitted", (task.id, episode.stop_reason, episode.detail)
        append_conversations(out, episode_conversations(episode, harness, {"task": task.id}))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
