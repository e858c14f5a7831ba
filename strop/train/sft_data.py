"""What SFT trains and evaluates on: the scripted demonstrator's episodes, logged product sessions
(`sft.traces`, `strop.train.traces`), or both mixed by weight (`sft.trace_share`).

Each source holds out its own last `sft.val_fraction` (whole episodes, whole sessions); the
held-out loss is over both. A batch of `sft.batch_size` segments takes round(batch_size x
trace_share) of them from the traces and the rest from the demonstrations, each source in its own
length-sorted epoch order (`strop.train.sft.length_batches`).
"""

from dataclasses import dataclass, field, replace
from pathlib import Path

from strop.config import Config
from strop.env.segment import Segment


def trace_slots(cfg: Config) -> int:
    """How many segments of each batch come from the logged traces."""
    return round(cfg.sft.batch_size * cfg.sft.trace_share) if cfg.sft.traces else 0


def uses_demonstrations(cfg: Config) -> bool:
    return trace_slots(cfg) < cfg.sft.batch_size


def trace_harness(cfg: Config, tokenizer):
    """The harness logged sessions are rendered through: the run's tool set and chat format."""
    from strop.env.harness import Harness
    from strop.train.sft import demonstration_harness

    return Harness(tokenizer, demonstration_harness(cfg))


@dataclass
class SFTData:
    pools: list[tuple[list[Segment], int]]  # (training segments, how many of each batch come from them)
    val: list[Segment]
    figures: dict  # what the result reports about the data
    _orders: list[list[list[int]]] = field(default_factory=list)

    def batch(self, rng) -> list[Segment]:
        """The next batch: its share from each pool, each pool's epochs in length-sorted order."""
        from strop.train.sft import length_batches

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
    from strop.errors import UserError
    from strop.train.sft import load_demonstrations, summary_forced
    from strop.train.traces import trace_segments

    s = cfg.sft
    pools, val, figures = [], [], {}
    n_traces = trace_slots(cfg)
    if s.traces and n_traces == 0:
        print(f"[sft] sft.trace_share = {s.trace_share} takes no trace into a batch of {s.batch_size}", flush=True)
    if n_traces:
        segments, too_long = trace_segments(trace_harness(cfg, tokenizer), s.traces, cfg.model.max_positions)
        if len(segments) < 2:
            raise UserError(f"sft.traces {s.traces!r}: {len(segments)} usable conversation(s); need at least 2")
        n_val = _held_out(segments, s.val_fraction)
        pools.append((segments[:-n_val], n_traces))
        val += segments[-n_val:]
        figures |= {"traces": len(segments), "traces_too_long": too_long, "trace_val_segments": n_val}
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
