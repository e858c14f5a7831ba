"""SFT trains only on the policy's own tokens and keeps the weights of its best held-out loss."""

import json

import torch

from strop.config import from_dict
from strop.env.episode import Episode, Segment
from strop.model.policy import build_model, load_model, save_model
from strop.train.sft import masked_nll, pad_batch, sft
from tests.conftest import tiny_model_section


def demo_episode(tokenizer, i: int) -> Episode:
    seg = Segment()
    seg.add_forced(tokenizer.encode(f"<|im_start|>user\nfix bug {i}<|im_end|>\n<|im_start|>assistant\n"))
    answer = tokenizer.encode('<tool_call>{"name": "submit", "arguments": {}}</tool_call><|im_end|>')
    seg.add_generated(answer, [0.0] * len(answer), [0] * len(answer), None)
    return Episode(segments=[seg], messages=[], tool_calls=[], stop_reason="submitted", turns=1, timings={})


def test_pad_batch_masks_only_generated_targets(tiny_tokenizer):
    ep = demo_episode(tiny_tokenizer, 1)
    inputs, targets, mask = pad_batch(ep.segments, tiny_tokenizer.pad_token_id)
    seg = ep.segments[0]
    assert inputs.shape == targets.shape == mask.shape == (1, len(seg) - 1)
    assert mask.sum().item() == sum(seg.loss_mask)
    assert torch.equal(targets[mask], torch.tensor(seg.input_ids)[torch.tensor(seg.loss_mask, dtype=torch.bool)])


def test_sft_learns_demonstrations_and_saves_best(tiny_tokenizer, tmp_path):
    base = tmp_path / "base"
    save_model(build_model(tiny_model_section(), tiny_tokenizer), tiny_tokenizer, base)
    cfg = from_dict(
        {
            "run": {"out_dir": str(tmp_path), "name": "r"},
            "sft": {
                "episodes": 12,
                "batch_size": 4,
                "lr": 3e-3,
                "max_steps": 60,
                "eval_every": 10,
                "patience": 2,
                "warmup_steps": 2,
                "val_fraction": 0.25,
            },
        }
    )
    out = tmp_path / "r" / "sft"
    out.mkdir(parents=True)
    episodes = [demo_episode(tiny_tokenizer, i) for i in range(12)]
    (out / "demos.jsonl").write_text("".join(json.dumps(e.to_dict()) + "\n" for e in episodes))

    before, _ = masked_nll(load_model(base), [e.segments[0] for e in episodes[-3:]], tiny_tokenizer.pad_token_id)
    result = sft(cfg, str(base))
    assert result["val_segments"] == 3 and result["train_segments"] == 9
    assert result["val_loss"] < before.item() * 0.5
    after, _ = masked_nll(
        load_model(out / "model"), [e.segments[0] for e in episodes[-3:]], tiny_tokenizer.pad_token_id
    )
    assert abs(after.item() - result["val_loss"]) < 1e-4  # the saved model is the best one


def test_sft_on_two_ranks_matches_one(tiny_tokenizer, tmp_path):
    """`trainer.parallel.fsdp = 2`: the same steps on a model sharded over two ranks end at the
    single process's held-out loss (to float32 rounding), and the saved model is whole."""
    base = tmp_path / "base"
    save_model(build_model(tiny_model_section(), tiny_tokenizer), tiny_tokenizer, base)
    episodes = [demo_episode(tiny_tokenizer, i) for i in range(12)]
    results = {}
    for n in (1, 2):
        cfg = from_dict(
            {
                "run": {"out_dir": str(tmp_path), "name": f"r{n}"},
                "trainer": {"parallel": {"fsdp": n}},
                "sft": {
                    "episodes": 12,
                    "batch_size": 3,
                    "lr": 3e-3,
                    "max_steps": 6,
                    "eval_every": 3,
                    "patience": 2,
                    "warmup_steps": 2,
                    "val_fraction": 0.25,
                },
            }
        )
        out = tmp_path / f"r{n}" / "sft"
        out.mkdir(parents=True)
        (out / "demos.jsonl").write_text("".join(json.dumps(e.to_dict()) + "\n" for e in episodes))
        results[n] = sft(cfg, str(base))
        saved, _ = masked_nll(
            load_model(out / "model"), [e.segments[0] for e in episodes[-3:]], tiny_tokenizer.pad_token_id
        )
        assert abs(saved.item() - results[n]["val_loss"]) < 1e-4  # the saved model is the best one, whole
    assert results[2]["ranks"] == 2 and results[2]["steps"] == results[1]["steps"]
    assert abs(results[2]["val_loss"] - results[1]["val_loss"]) < 1e-5
