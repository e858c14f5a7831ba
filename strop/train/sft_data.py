"""What SFT trains and evaluates on: the scripted demonstrator's episodes, logged product sessions
(`sft.traces`, `strop.train.traces`), or both mixed by weight (`sft.trace_share`).

Each source holds out its own last `sft.val_fraction` (whole episodes, whole sessions); the
held-out loss is over both. A batch of `sft.batch_size` segments takes round(batch_size x
trace_share) of them from the traces and the rest from the demonstrations, each source in its own
length-sorted epoch order (`length_batches`).
"""

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from strop.config import Config, SFTSection
from strop.env.episode import Segment
from strop.errors import UserError
from strop.outputs import write_atomic


def trace_slots(cfg: Config) -> int:
    """How many segments of each batch come from the logged traces."""
    return round(cfg.sft.batch_size * cfg.sft.trace_share) if cfg.sft.traces else 0


def uses_demonstrations(cfg: Config) -> bool:
    return trace_slots(cfg) < cfg.sft.batch_size


def trace_harness(cfg: Config, tokenizer):
    """The harness logged sessions are rendered through: the run's tool set and chat format."""
    from strop.env.harness.loop import Harness

    return Harness(tokenizer, demonstration_harness(cfg))


@dataclass
class SFTData:
    pools: list[tuple[list[Segment], int]]  # (training segments, how many of each batch come from them)
    val: list[Segment]
    figures: dict  # what the result reports about the data
    _orders: list[list[list[int]]] = field(default_factory=list)

    def batch(self, rng) -> list[Segment]:
        """The next batch: its share from each pool, each pool's epochs in length-sorted order."""
        if not self._orders:
            self._orders = [[] for _ in self.pools]
        out = []
        for k, (segments, size) in enumerate(self.pools):
            if not self._orders[k]:
                self._orders[k] = length_batches([len(s) for s in segments], size, rng)
            out += [segments[i] for i in self._orders[k].pop()]
        return out


def _held_out(items: list, fraction: float) -> int:
    return max(1, int(len(items) * fraction))


def sft_data(cfg: Config, tokenizer, demos_path: Path) -> SFTData:
    """The training pools and held-out segments `[sft]` describes."""
    from strop.train.traces import trace_segments

    s = cfg.sft
    pools, val, figures = [], [], {}
    n_traces = trace_slots(cfg)
    if s.traces and n_traces == 0:
        print(f"[sft] sft.trace_share = {s.trace_share} takes no trace into a batch of {s.batch_size}", flush=True)
    if n_traces:
        harness = trace_harness(cfg, tokenizer)
        segments, read = trace_segments(harness, s.traces, cfg.model.max_positions, s.max_traces)
        if len(segments) < 2:
            raise UserError(f"sft.traces {s.traces!r}: {len(segments)} usable conversation(s); need at least 2")
        n_val = _held_out(segments, s.val_fraction)
        pools.append((segments[:-n_val], n_traces))
        val += segments[-n_val:]
        figures |= {"traces": len(segments), **read, "trace_val_segments": n_val}
    if s.batch_size - n_traces:
        episodes = load_demonstrations(cfg, tokenizer, demos_path)
        n_val = _held_out(episodes, s.val_fraction)
        if not s.train_summaries:
            episodes = [replace(ep, segments=[summary_forced(seg) for seg in ep.segments]) for ep in episodes]
        train = [seg for ep in episodes[:-n_val] for seg in ep.segments if sum(seg.loss_mask)]
        pools.append((train, s.batch_size - n_traces))
        val += [seg for ep in episodes[-n_val:] for seg in ep.segments if sum(seg.loss_mask)]
        figures["demos"] = len(episodes)
    figures |= {"train_segments": sum(len(p) for p, _ in pools), "val_segments": len(val)}
    return SFTData(pools, val, figures)


def load_demonstrations(cfg: Config, tokenizer, path: Path) -> list:
    """The oracle's episodes on the suite's train split, produced once and cached as JSONL."""
    from strop.env.demonstrators.runs import collect_demonstrations
    from strop.env.episode import Episode

    if path.is_file():
        return [Episode.from_dict(json.loads(line)) for line in path.read_text().splitlines()]
    harness = demonstration_harness(cfg)
    episodes, styles = collect_demonstrations(
        cfg.sft.suite,
        "train",
        tokenizer,
        limit=cfg.sft.episodes,
        config=harness,
        check=cfg.sft.demo_check,
        mix=demonstrator_mix(cfg.sft),
        workers=cfg.sft.demo_workers,
        difficulties=cfg.sft.difficulties,
        seed=cfg.run.seed,
    )
    print(f"[sft] demonstrations: {len(episodes)} kept; {json.dumps(styles)}", flush=True)
    if len(episodes) < 2:
        raise UserError(f"only {len(episodes)} oracle demonstrations on suite {cfg.sft.suite!r}; need at least 2")
    write_atomic(path, "".join(json.dumps(ep.to_dict()) + "\n" for ep in episodes))  # a cache: whole or absent
    return episodes


def demonstration_harness(cfg: Config):
    """The harness demonstrations run in: the model's whole window; or, when the rollout resets its
    context (`rollout.context_strategy`), the rollout's own harness, so that the demonstrations hold
    the resets and summaries the policy is to learn."""
    from strop.env.demonstrators.runs import DEMONSTRATION_HARNESS
    from strop.env.harness.loop import harness_config

    run = harness_config(cfg.rollout, cfg.harness)
    if cfg.rollout.context_strategy == "none":
        return replace(
            DEMONSTRATION_HARNESS,
            max_context=cfg.model.max_positions,
            tools=run.tools,
            system=run.system,
            chat_template=run.chat_template,
            tool_parser=run.tool_parser,
        )
    return run


def demonstrator_mix(s: SFTSection):
    """The demonstrator population the `[sft]` section describes."""
    from strop.env.demonstrators.imperfect import DemonstratorMix

    return DemonstratorMix(
        careful=s.careful, suspects=s.suspects, misremember=s.misremember, max_wrong=s.max_wrong, run_tests=s.demo_tests
    )


def summary_forced(seg: Segment) -> Segment:
    """`seg` with the summary it ends with (the reply to the harness's summary request) out of the
    loss, as context; a window that ends otherwise is returned as it is."""
    from strop.env.harness.loop import SUMMARY_MESSAGE

    if len(seg.messages) < 2 or seg.messages[-2] != SUMMARY_MESSAGE or not any(seg.loss_mask):
        return seg
    end = max(i for i, m in enumerate(seg.loss_mask) if m) + 1
    start = end
    while start > 0 and seg.loss_mask[start - 1]:
        start -= 1
    return replace(seg, loss_mask=seg.loss_mask[:start] + [0] * (end - start) + seg.loss_mask[end:])


def length_batches(lengths: list[int], batch_size: int, rng, pool: int = 8) -> list[list[int]]:
    """One epoch of batches: a random order, cut into pools of `pool` batches whose members are
    sorted by length, so a batch pads to a length near its members' own (padding, and attention
    over it, was a fifth of a step) while every batch still mixes episodes from across the data."""
    order = rng.permutation(len(lengths)).tolist()
    batches = []
    for i in range(0, len(order), batch_size * pool):
        chunk = sorted(order[i : i + batch_size * pool], key=lambda j: lengths[j])
        batches += [chunk[k : k + batch_size] for k in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches
