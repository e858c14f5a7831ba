"""The long-horizon `chain` suite and its demonstrator: generation is deterministic with disjoint
splits and records the facts a later step needs; the reference solution scores 1 and the stub 0 with
the real checker; the demonstrator, which knows only its window, solves a chain many windows long
with its own summaries, loses keys under truncation, and the probe counts what each carried state lost."""

import pytest

from strop.env.demonstrators.chain import ChainDemonstrator, spelled
from strop.env.demonstrators.runs import solve
from strop.env.grading.checker import check
from strop.env.harness.context import facts_lost
from strop.env.harness.loop import Harness, HarnessConfig, run_task
from strop.env.suites.chain import STAGES, make_task
from strop.env.tasks.suites import get_task, load_suite
from strop.env.world.patches import apply_edits
from strop.errors import UserError

WINDOW = 2400  # the test tokenizer spends about twice the default one's tokens per line


def test_generation_is_deterministic_and_records_the_facts():
    a, b = make_task(2, "eval", 3), make_task(2, "eval", 3)
    assert a == b and a.id == "chain-d2-eval-0003" and get_task("chain", a.id) == a
    assert len(a.metadata["facts"]) == len(a.metadata["chain"]) == STAGES[2]
    for i, (path, key) in enumerate(zip(a.metadata["chain"], a.metadata["facts"])):
        assert f"STAGE {i} KEY: {key}" in a.files[path]
    assert a.metadata["chain"][0] in a.instruction and a.metadata["facts"][0] not in a.instruction
    train, evals = (
        {"-".join(t.metadata["facts"]) for t in load_suite("chain", split, difficulty=1, limit=50)}
        for split in ("train", "eval")
    )
    assert len(train) == len(evals) == 50 and not train & evals
    with pytest.raises(UserError):
        load_suite("chain", "eval", difficulty=9)


def test_reference_scores_one_stub_zero_and_each_carried_key_its_share():
    """RL's reward (`score_changes`, the suite's "fraction" mode): a key right at its place earns a
    share, the count of keys one more; only every key, and no other, solves."""
    from strop.rl.rollout import score_changes

    task = make_task(1, "eval", 0)
    assert check(task, apply_edits(task.files, task.metadata["reference_edits"]), perturbed=False).reward == 1.0

    def answer(text):
        return apply_edits(task.files, [{**task.metadata["reference_edits"][0], "new": f"    return {text!r}\n"}])

    keys = task.metadata["facts"]
    assert score_changes(task, answer("x")).reward == 0.0
    assert check(task, answer(" ".join([*keys[:3], "0000-0000"])), perturbed=False).reward == 0.0  # binary
    assert score_changes(task, answer(" ".join([*keys[:3], "0000-0000"]))).reward == 0.8
    assert score_changes(task, answer(" ".join(keys[:2]))).reward == 0.4  # two keys; the count is wrong
    assert score_changes(task, answer(" ".join(keys + keys[:1]))).reward == 0.8


def episode(tok, task, strategy, careful=True, **config):
    harness = Harness(
        tok,
        HarnessConfig(
            max_context=WINDOW,
            max_turn_tokens=256,
            summary_tokens=200,
            max_turns=40,
            context_strategy=strategy,
            max_resets=20,
            **config,
        ),
    )
    return run_task(harness, ChainDemonstrator(task, harness.format, careful=careful), task)


def test_summaries_carry_a_long_chain_and_truncation_loses_it(tiny_tokenizer):
    task = make_task(2, "eval", 1)
    ep, changes = episode(tiny_tokenizer, task, "summarize")
    assert ep.stop_reason == "submitted" and len(ep.resets) >= 5
    assert check(task, changes, perturbed=False).reward == 1.0
    # the last summary spells the keys as the answer does (`spelled`), quotes and spaces included
    answer = changes["solution.py"].decode().split("return ")[1].strip()
    assert answer == spelled(task.metadata["facts"]) and answer in ep.resets[-1]["carried"][0]["content"]
    lost, found = facts_lost(ep.resets, ep.tool_calls, task.metadata["facts"])
    assert found > 0 and lost == 0
    assert all(len(s) <= WINDOW for s in ep.segments)
    # the window keeps room for a read as long as the longest yet, so every summary saw the read
    # before it and the carried state is the summary alone (no turn carried verbatim), and no
    # window is reset twice without a turn between
    assert all(len(r["carried"]) == 1 for r in ep.resets)
    assert len({r["turn"] for r in ep.resets}) == len(ep.resets)

    ep, changes = episode(tiny_tokenizer, task, "truncation")
    assert ep.stop_reason != "submitted" and ep.resets
    lost, found = facts_lost(ep.resets, ep.tool_calls, task.metadata["facts"])
    assert lost > 0 and lost <= found


def test_a_careless_demonstrator_keeps_recent_keys_and_submits_a_wrong_answer(tiny_tokenizer):
    """The SFT mix's other summarizer: each summary keeps the last RECENT_KEYS stages' keys, so the
    first summary with more than that drops stage 0's; it follows the chain on and submits the keys it
    kept. Up to that summary its episode is the careful one's, token for token."""
    from strop.bench.longctx_report import KEY
    from strop.env.demonstrators.chain import RECENT_KEYS
    from strop.rl.rollout import score_changes

    task = make_task(2, "eval", 1)
    careful, _ = episode(tiny_tokenizer, task, "summarize")
    ep, changes = episode(tiny_tokenizer, task, "summarize", careful=False)
    assert ep.stop_reason == "submitted" and len(ep.resets) >= 5
    summaries = [r["carried"][0]["content"] for r in ep.resets]
    assert all(len(KEY.findall(s)) <= RECENT_KEYS for s in summaries)
    dropped = next(i for i, s in enumerate(summaries) if "Keys from stage 0 on:" not in s)
    assert summaries[:dropped] == [r["carried"][0]["content"] for r in careful.resets[:dropped]]
    lost, found = facts_lost(ep.resets, ep.tool_calls, task.metadata["facts"])
    assert lost > 0
    assert check(task, changes, perturbed=False).reward == 0.0
    assert score_changes(task, changes).reward < 0.2


def test_the_oracle_solves_a_chain_that_fits_its_window(tiny_tokenizer):
    report = solve([make_task(1, "train", 0)], tiny_tokenizer, HarnessConfig(max_context=8192, max_turns=10))
    assert report["rate"] == 1.0 and report["episodes"]


def test_sft_can_keep_the_summaries_out_of_the_loss(tiny_tokenizer):
    """`sft.train_summaries = false`: each window's summary stays in its tokens but leaves the loss;
    the turns before it, and the last window (which ends with no summary), are trained as before."""
    from strop.train.sft_data import summary_forced

    ep, _ = episode(tiny_tokenizer, make_task(2, "eval", 1), "summarize")
    for seg in ep.segments:
        forced = summary_forced(seg)
        assert forced.input_ids == seg.input_ids
        dropped = [t for t, a, b in zip(seg.input_ids, seg.loss_mask, forced.loss_mask) if a and not b]
        if seg is ep.segments[-1]:
            assert forced.loss_mask == seg.loss_mask
        else:
            assert tiny_tokenizer.decode(dropped).strip().startswith(seg.messages[-1]["content"].strip())
            assert 0 < sum(forced.loss_mask) < sum(seg.loss_mask)
