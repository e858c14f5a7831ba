"""The RL trainer: owns the policy (fp32 master weights, AdamW), turns `Sample`s into padded
token batches, recomputes the policy's logprobs of the sampled tokens, runs the loss, steps, and
publishes the new version as a bf16 snapshot. It computes on its rank's device (`ranks.device`:
the CPU or a GPU), in fp32 or under bf16 autocast (`precision`, `strop.train.device`); what it
publishes and returns is on the host. Samples whose advantage is 0 contribute exactly
nothing to the update (without a KL term), so they run forward-only, for the step's metrics.

It is algorithm-blind: advantages and per-token weights come in with the samples
(`strop.rl.advantages`), the objective is `strop.rl.loss.policy_loss`. Two things come from
outside as plain callables, so the trainer runs before they exist and never imports them:

- `replay_ctx(model, batch)` -> context manager around each forward; router replay for MoE passes
  a function that makes the forward route through the experts the engine recorded
  (`batch.routing`). The default does nothing.
- `publish(version, bf16_state_dict)` after every step: the weight-sync interface (full
  snapshots; a delta encoder can sit behind the same call). Or, when given,
  `publish_shards(version, bf16_shards)`: each rank of a sharded trainer publishes its own shards,
  and the model is not gathered.

The staleness bound is checked once more where it matters, on the samples a step is given.
`save(dir)` / `load(dir)` checkpoint the model, the optimizer, the version and torch's RNG:
loading one and repeating a step gives bitwise the same weights (with the same threads).

Sharded over several ranks (`ranks`, `strop.train.parallel`), every rank runs this same code on
the same samples: each does its share of the step's micro-batches, the metrics are summed over
the ranks, and `save` writes each rank's shards (a torch distributed checkpoint), so a checkpoint
taken at one rank count loads at any other.
"""

import contextlib
import dataclasses
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import torch.nn.functional as F

from strop.config import RLSection
from strop.env.episode import Segment
from strop.model.mismatch import mismatch_metrics
from strop.model.policy import logits_at
from strop.rl.advantages import Sample
from strop.rl.loss import policy_loss
from strop.train.device import Precision, peak_memory_mib
from strop.train.parallel import Ranks, local, shard_offset, whole
from strop.train.sharded_checkpoint import load_sharded, save_sharded


@dataclass
class TrainBatch:
    """One micro-batch, right-padded. Position t of a row reads input_ids_BT[t] and is scored on
    predicting targets_BT[t] (the segment shifted by one)."""

    input_ids_BT: torch.Tensor  # long
    targets_BT: torch.Tensor  # long
    mask_BT: torch.Tensor  # bool: the target is a policy-generated token
    behavior_BT: torch.Tensor  # float32: the engine's logprob of the target
    advantages_BT: torch.Tensor  # float32
    weights_BT: torch.Tensor  # float32 per-token loss weights
    lengths_B: torch.Tensor  # long: unpadded input length of each row
    temperature_B: torch.Tensor  # float32: the temperature each row was sampled at (logits are divided by it)
    routing: list[list]  # per row, per input position: the experts it was routed through (None where not recorded)

    def to(self, device: torch.device) -> "TrainBatch":
        """The batch with its tensors on `device` (routing stays host data)."""
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return TrainBatch(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in moved.items()})


ReplayContext = Callable[[Any, TrainBatch], ContextManager]


def no_replay(model, batch: TrainBatch) -> ContextManager:
    return contextlib.nullcontext()


def build_batch(rows: list[tuple[Segment, float, float]], pad_id: int) -> TrainBatch:
    """(segment, advantage, weight) rows -> a padded `TrainBatch` (advantage and weight apply to
    the segment's generated tokens)."""
    width = max(len(seg) for seg, _, _ in rows) - 1
    B = len(rows)
    ids = torch.full((B, width + 1), pad_id, dtype=torch.long)
    mask = torch.zeros(B, width + 1, dtype=torch.bool)
    behavior = torch.zeros(B, width + 1)
    for r, (seg, _, _) in enumerate(rows):
        n = len(seg)
        ids[r, :n] = torch.tensor(seg.input_ids)
        mask[r, :n] = torch.tensor(seg.loss_mask, dtype=torch.bool)
        behavior[r, :n] = torch.tensor(seg.behavior_logprobs, dtype=torch.float32)
    mask = mask[:, 1:]
    adv = torch.tensor([a for _, a, _ in rows], dtype=torch.float32)[:, None] * mask
    weights = torch.tensor([w for _, _, w in rows], dtype=torch.float32)[:, None] * mask
    return TrainBatch(
        input_ids_BT=ids[:, :-1],
        targets_BT=ids[:, 1:],
        mask_BT=mask,
        behavior_BT=behavior[:, 1:],
        advantages_BT=adv,
        weights_BT=weights,
        lengths_B=torch.tensor([len(seg) - 1 for seg, _, _ in rows]),
        # 0 is greedy: no distribution was sampled from, and such rows are not trained on.
        temperature_B=torch.tensor([seg.temperature or 1.0 for seg, _, _ in rows], dtype=torch.float32),
        # Segment.routing[j] belongs to the position that produced token j, i.e. input position j - 1
        routing=[list(seg.routing[1:]) for seg, _, _ in rows],
    )


def weightless(rows: list[tuple[Segment, float, float]]) -> list[tuple[Segment, float, float]]:
    """The same rows with advantage and weight 0: a micro-batch that runs but changes nothing."""
    return [(seg, 0.0, 0.0) for seg, _, _ in rows]


def token_logprobs(model, batch: TrainBatch) -> torch.Tensor:
    """[B, T] logprobs of the targets under the model at each row's sampling temperature (fp32),
    differentiable; computed on the policy's own tokens (`mask_BT`) only, 0 elsewhere."""
    mask = batch.mask_BT
    temperature = batch.temperature_B[:, None].expand(mask.shape)[mask]
    logits = logits_at(model, batch.input_ids_BT, mask) / temperature[:, None]
    lp = -F.cross_entropy(logits, batch.targets_BT[mask], reduction="none")
    return torch.zeros(mask.shape, dtype=lp.dtype, device=lp.device).masked_scatter(mask, lp)


class RLTrainer:
    def __init__(
        self,
        model,
        rl: RLSection,
        *,
        pad_id: int,
        publish: Callable[[int, dict[str, torch.Tensor]], None] = lambda version, state: None,
        publish_shards: Callable[[int, dict], None] | None = None,
        replay_ctx: ReplayContext = no_replay,
        log: Callable[[dict], None] = lambda row: None,
        version: int = 0,
        ranks: Ranks | None = None,
        reference=None,
        precision: Precision = Precision(),
    ):
        """`ranks`: the rank group `model` is already sharded over (`strop.train.parallel`), and its
        device; None = this process alone, on the CPU. A model of one process is moved to the
        device; a sharded one is already there. `reference`: the frozen policy `rl.ref_kl_coef`
        anchors to, sharded and placed like `model` (needed exactly when the coefficient is > 0).
        `precision`: fp32, or bf16 autocast over the fp32 master weights."""
        if (rl.ref_kl_coef > 0) != (reference is not None):
            raise ValueError("a reference policy is needed exactly when rl.ref_kl_coef > 0")
        self.ranks = ranks or Ranks()
        self.device, self.precision = self.ranks.device, precision
        if self.ranks.size == 1:
            model, reference = model.to(self.device), reference.to(self.device) if reference is not None else None
        self.model = model.float().train()  # fp32 master weights; engines get bf16 copies
        self.reference = reference.float().eval().requires_grad_(False) if reference is not None else None
        self.rl = rl
        self.pad_id = pad_id
        self.publish = publish
        self.publish_shards = publish_shards
        self.replay_ctx = replay_ctx
        self.log = log
        self.version = version
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=rl.lr, betas=(0.9, 0.95), weight_decay=rl.weight_decay
        )

    def step(self, samples: list[Sample]) -> dict:
        """One optimizer step on `samples` (normally all samples of `rl.batch_groups` groups);
        bumps `version`, publishes it, logs and returns the step's metrics."""
        assert samples, "a step needs samples"
        trajs = [s.trajectory for s in samples]
        staleness = Counter(self.version - t.min_version for t in trajs)
        assert max(staleness) <= self.rl.max_staleness, (
            f"staleness {max(staleness)} > rl.max_staleness at version {self.version}"
        )
        t0 = time.perf_counter()
        rows = [(seg, s.advantage, s.weight) for s in samples for seg in s.trajectory.segments if any(seg.loss_mask)]
        rows.sort(key=lambda row: len(row[0]))  # similar lengths share a micro-batch: less padding
        # A row with advantage 0 (its group all solved or all failed) has a loss of exactly 0 when no
        # KL term is added: it only needs a forward pass, for the step's mismatch metrics, not a
        # backward one; and `rl.idle_rows` of them, spread over the lengths, measure that as well.
        train_all = self.rl.kl_coef > 0 or self.reference is not None or not self.rl.skip_zero_advantage
        learning = [row for row in rows if train_all or row[1] != 0.0]
        idle = [row for row in rows if not train_all and row[1] == 0.0]
        idle = idle[:: -(-len(idle) // self.rl.idle_rows)] if self.rl.idle_rows and idle else []
        self.optimizer.zero_grad(set_to_none=True)
        sums: Counter = Counter()
        loss_total, tokens = 0.0, 0
        behavior_lp, trainer_lp = [], []  # on generated tokens, for the mismatch metrics
        learned: list[
            tuple[TrainBatch, torch.Tensor, bool]
        ] = []  # learning batches, their logprobs before the step, counted
        mb = self.rl.micro_batch
        # This rank's share of the micro-batches (all of them in one process), learning ones first.
        chunks = [
            (learn, chunk, counted)
            for learn, part in ((True, learning), (False, idle))
            for chunk, counted in self.ranks.share([part[i : i + mb] for i in range(0, len(part), mb)], weightless)
        ]
        clock: Counter = Counter()  # seconds: forward (with the loss), backward, optimizer, measure
        for learn, chunk, counted in chunks:
            batch = build_batch(chunk, self.pad_id).to(self.device)
            t_fwd = time.perf_counter()
            with self.replay_ctx(self.model, batch), torch.set_grad_enabled(learn):
                with self.precision.autocast(self.device):
                    logprobs = token_logprobs(self.model, batch)
                    loss, m = policy_loss(
                        logprobs,
                        batch.behavior_BT,
                        batch.advantages_BT,
                        batch.weights_BT,
                        batch.mask_BT,
                        self.rl,
                        self._reference_logprobs(batch),
                    )
                t_bwd = time.perf_counter()
                clock["forward_s"] += t_bwd - t_fwd
                if learn:
                    # weights carry the normalisation: micro-batch losses add up to the batch loss. Inside
                    # the replay context: activation checkpointing recomputes the forward here.
                    loss.backward()
                    learned.append((batch, logprobs.detach(), counted))
                    clock["backward_s"] += time.perf_counter() - t_bwd
            if not counted:
                continue
            loss_total += loss.item() if learn else 0.0
            behavior_lp.append(batch.behavior_BT[batch.mask_BT].cpu())  # host tensors: gathered as objects
            trainer_lp.append(logprobs.detach()[batch.mask_BT].cpu())
            tokens += int(batch.lengths_B.sum())
            for k, v in m.items():
                sums[k] += v * m["tokens"] if k != "tokens" else v
        t_opt = time.perf_counter()
        clip = self.rl.grad_clip if self.rl.grad_clip > 0 else float("inf")
        grad_norm = whole(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        every = self.rl.measure_every
        measured = bool(learned) and every > 0 and self.version % every == 0
        before = [local(p).detach().clone() for p in self.model.parameters()] if measured else []
        self.optimizer.step()
        t_measure = time.perf_counter()
        clock["optimizer_s"] += t_measure - t_opt
        update = self._update_metrics(before, learned) if before else {}
        clock["measure_s"] += time.perf_counter() - t_measure
        parts = self.ranks.gather((loss_total, sums, tokens, behavior_lp, trainer_lp))
        loss_total, tokens = sum(p[0] for p in parts), sum(p[2] for p in parts)
        sums = sum((p[1] for p in parts), Counter())
        behavior_lp, trainer_lp = [t for p in parts for t in p[3]], [t for p in parts for t in p[4]]
        seconds = time.perf_counter() - t0
        self.version += 1
        t1 = time.perf_counter()
        self.publish_version()
        publish_s = time.perf_counter() - t1

        # Behavior vs trainer logprobs: engine/trainer mismatch, plus policy drift for stale samples.
        mismatch = mismatch_metrics(torch.cat(behavior_lp), torch.cat(trainer_lp)) if behavior_lp else {}
        n_tok = max(sums["tokens"], 1.0)
        row = {
            "version": self.version,
            "loss": loss_total,
            "grad_norm": float(grad_norm),
            "samples": len(trajs),
            "reward": sum(t.reward for t in trajs) / len(trajs),
            "train_reward": sum(s.reward for s in samples) / len(samples),
            "solve_rate": sum(t.solved for t in trajs) / len(trajs),
            "hacked": sum(bool(t.hack_flags) for t in trajs),
            **{k: sums[k] / n_tok for k in ("k3", "ref_kl", "clip_frac", "mask_frac", "trunc_frac", "ratio_mean")},
            **{f"mismatch_{k}": v for k, v in mismatch.items() if k not in ("tokens", "k3")},
            **update,
            "gen_tokens": int(sums["tokens"]),
            "no_signal_frac": 1 - len(learning) / max(len(rows), 1),  # rows of advantage 0
            "tokens": int(tokens),  # every position trained on (context and generated)
            "tokens_per_s": tokens / seconds,
            "staleness_max": max(staleness),
            "staleness_hist": {str(k): staleness[k] for k in sorted(staleness)},
            "step_s": seconds,
            **{k: clock[k] for k in ("forward_s", "backward_s", "optimizer_s", "measure_s")},
            "publish_s": publish_s,
            "peak_mem_mib": peak_memory_mib(self.device),  # rank 0's: GPU memory allocated, or the process's RSS
        }
        self.log(row)
        return row

    @torch.no_grad()
    def _reference_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        """The reference policy's logprobs of the batch's targets (None without a reference)."""
        if self.reference is None:
            return None
        with self.replay_ctx(self.reference, batch), self.precision.autocast(self.device):
            return token_logprobs(self.reference, batch)

    @torch.no_grad()
    def _update_metrics(self, before: list[torch.Tensor], learned: list[tuple[TrainBatch, torch.Tensor, bool]]) -> dict:
        """How much the step changed the policy: the update's size relative to the weights, and how
        far the logprobs of the sampled tokens moved (mean over tokens with positive and with negative
        advantage; RL that learns raises the first and lowers the second), and `objective_gain`, how
        much the step raised its own batch's objective, sum of weight * advantage * logprob change.
        A gradient step that lowers the very objective it followed overshot: the learning rate is past
        where its first-order gain outweighs the rest. One extra forward pass over the learning rows.
        `before` holds this rank's shards; each rank sums over its own."""
        params = [local(p) for p in self.model.parameters()]
        delta = sum(float((p - b).double().pow(2).sum()) for p, b in zip(params, before))
        norm = sum(float(b.double().pow(2).sum()) for b in before)
        moved = {"pos": [], "neg": []}
        gain = 0.0
        for batch, old_lp, counted in learned:
            with self.replay_ctx(self.model, batch), self.precision.autocast(self.device):
                new_lp = token_logprobs(self.model, batch)
            if not counted:
                continue
            diff = (new_lp - old_lp)[batch.mask_BT]
            adv = batch.advantages_BT[batch.mask_BT]
            gain += float((diff * adv * batch.weights_BT[batch.mask_BT]).double().sum())
            moved["pos"].append(diff[adv > 0].cpu())
            moved["neg"].append(diff[adv < 0].cpu())
        parts = self.ranks.gather((delta, norm, moved, gain))
        delta, norm = sum(p[0] for p in parts), sum(p[1] for p in parts)
        out = {"update_rel": (delta / max(norm, 1e-30)) ** 0.5, "objective_gain": sum(p[3] for p in parts)}
        for sign in moved:
            d = torch.cat([t for p in parts for t in p[2][sign]])
            out[f"dlogp_{sign}"] = float(d.mean()) if d.numel() else 0.0
        return out

    def memory(self) -> list[dict]:
        """Per rank, in rank order: MiB of the parameters and AdamW state it holds (its shards), its
        process's peak resident memory in MiB and, on a GPU, the peak GPU memory it allocated."""
        held = [local(p) for p in self.model.parameters()]
        held += [local(v) for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        state_mib = sum(t.numel() * t.element_size() for t in held) / 2**20
        mine = {
            "state_mib": state_mib,
            "peak_rss_mib": peak_memory_mib(torch.device("cpu")),
            "device": str(self.device),
        }
        if self.device.type == "cuda":
            mine["peak_gpu_mib"] = peak_memory_mib(self.device)
        return self.ranks.gather(mine)

    def publish_version(self) -> None:
        """Hand the current version to `publish` (the whole bf16 state dict), or to `publish_shards`
        when it is set (this rank's bf16 shards: nothing is gathered)."""
        if self.publish_shards is None:
            self.publish(self.version, self.bf16_state_dict())
        else:
            self.publish_shards(self.version, self.bf16_shards())

    def bf16_shards(self) -> dict[str, tuple[tuple[int, ...], int, torch.Tensor]]:
        """This rank's shards of the model in bf16, gathering nothing: name -> (the whole tensor's
        shape, the flat offset of this rank's shard in it, the shard). A tensor every rank holds
        whole is rank 0's; empty shards are left out. In one process: every tensor, whole, at 0."""
        out = {}
        for k, v in self.model.state_dict().items():
            shard = local(v)
            if shard.numel() and (shard is not v or self.ranks.rank == 0):
                out[k] = (tuple(v.shape), shard_offset(v), shard.detach().to(torch.bfloat16).cpu())
        return out

    def bf16_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model in bf16 on the host (gathered from the shards on every rank when sharded)."""
        return {k: whole(v).detach().to(torch.bfloat16).cpu() for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict:
        """The model's whole tensors on the host (gathered on every rank when sharded, a copy: later
        steps do not change it) and the version: for the final model and for comparisons. Checkpoints
        are `save`."""
        return {
            "model": {k: whole(v).detach().cpu().clone() for k, v in self.model.state_dict().items()},
            "version": self.version,
        }

    def save(self, path: Path) -> None:
        """Every rank: its shards of the model and the optimizer, the version and torch's RNG, into
        the directory `path` (`strop.train.sharded_checkpoint.save_sharded`), without gathering the model."""
        extra = {"version": self.version, "rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            extra["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        save_sharded(path, self.model, self.optimizer, self.ranks, extra)

    def load(self, path: Path) -> None:
        """Every rank: load what `save` wrote in `path`, at this or any other number of ranks (and
        on another device: a CPU checkpoint resumes on a GPU)."""
        extra = load_sharded(path, self.model, self.optimizer, self.ranks)
        self.version = extra["version"]
        torch.set_rng_state(extra["rng"])
        if self.device.type == "cuda" and "cuda_rng" in extra:
            torch.cuda.set_rng_state(extra["cuda_rng"], self.device)
