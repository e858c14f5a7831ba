"""SFT warm start: train the mid-trained policy on the oracle's demonstration episodes, with loss
on the assistant's tokens only, so it speaks the tool-call format before RL makes it good.

Training stops by early stopping on held-out demonstration loss (whole episodes held out), not by
a short budget, and the best weights are kept: the gain RL shows must not come from a weak start.

Outputs in `<run_dir>/sft/`: `demos.jsonl` (cached demonstrations), `model/` (best weights, HF
format; written at every improvement, so a killed run leaves its best so far), `metrics.jsonl`,
`loss.png`, and `result.json` once training has finished.
"""

import json
import time
from pathlib import Path

from strop.config import Config, to_dict
from strop.outputs import write_atomic
from strop.train.schedule import warmup_cosine


def pad_batch(segments: list, pad_id: int):
    """(inputs, targets, target_mask) tensors of shape (B, T-1) from variable-length segments."""
    import torch

    width = max(len(s.input_ids) for s in segments)
    ids = torch.full((len(segments), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(segments), width, dtype=torch.bool)
    for r, s in enumerate(segments):
        ids[r, : len(s.input_ids)] = torch.tensor(s.input_ids)
        mask[r, : len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.bool)
    return ids[:, :-1], ids[:, 1:], mask[:, 1:]


def masked_nll(model, segments: list, pad_id: int):
    """Mean next-token NLL over the policy's own tokens (loss_mask 1) and how many there were."""
    import torch
    import torch.nn.functional as F

    from strop.model.policy import logits_at

    inputs, targets, mask = (t.to(model.device) for t in pad_batch(segments, pad_id))
    n = int(mask.sum())
    if not n:
        return torch.zeros((), requires_grad=True), 0
    return F.cross_entropy(logits_at(model, inputs, mask), targets[mask]), n


def summed_nll(model, segments: list, counted: list[bool], pad_id: int):
    """Summed next-token NLL over the policy's own tokens of the `counted` segments; the others run
    through the model but weigh nothing (a sharded rank's padding, `strop.train.parallel`)."""
    import torch
    import torch.nn.functional as F

    from strop.model.policy import logits_at

    inputs, targets, mask = (t.to(model.device) for t in pad_batch(segments, pad_id))
    nll = F.cross_entropy(logits_at(model, inputs, mask), targets[mask], reduction="none")
    weight = torch.tensor(counted, dtype=nll.dtype, device=nll.device)[:, None].expand(mask.shape)[mask]
    return (nll * weight).sum()


def sft(cfg: Config, base: str | None = None) -> dict:
    """Run (or report) SFT; with `trainer.parallel.fsdp = N > 1` this process is rank 0 of N ranks
    that train one model sharded between them (the others are worker processes it starts). Every
    rank computes where `[trainer]` says (`strop.train.device`)."""
    from strop.data.tokenizer import load_tokenizer
    from strop.threads import set_threads
    from strop.train.device import device_type, rank_device
    from strop.train.parallel import Ranks, start_ranks, stop_ranks
    from strop.train.sft_data import load_demonstrations, trace_harness, uses_demonstrations
    from strop.train.traces import trace_segments

    kind = device_type(cfg.trainer)  # before any work: cuda where there is none is the user's to fix
    n = cfg.trainer.parallel.fsdp
    threads = set_threads(max(1, set_threads(cfg.run.threads or None) // n))  # the cores split between the ranks
    base_dir = Path(base) if base else cfg.run_dir / "midtrain" / "model"
    out = cfg.run_dir / "sft"
    if (out / "result.json").is_file():  # finished: the model is in out/model
        return json.loads((out / "result.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(base_dir)
    if cfg.sft.traces:  # bad lines are the user's to fix before any rank starts
        trace_segments(trace_harness(cfg, tokenizer), cfg.sft.traces, cfg.model.max_positions, cfg.sft.max_traces)
    t0 = time.perf_counter()
    if uses_demonstrations(cfg):
        load_demonstrations(cfg, tokenizer, out / "demos.jsonl")  # cached before other ranks read it
    demos_s = round(time.perf_counter() - t0, 1)  # ~0 when they were cached
    if n == 1:
        return {**fit(Ranks(device=rank_device(kind)), cfg, str(base_dir)), "demos_s": demos_s}
    ranks, procs = start_ranks(n, fit, (cfg, str(base_dir)), threads, kind)
    try:
        return {**fit(ranks, cfg, str(base_dir)), "demos_s": demos_s}
    finally:
        stop_ranks(procs)


def fit(ranks, cfg: Config, base_dir: str) -> dict:
    """The SFT loop, run by every rank of `ranks` on the same batches: each rank takes its share of
    a batch's segments, and the summed NLL over the batch's tokens makes the ranks' gradients add
    up to the single process's. Rank 0 evaluates, decides and writes; the others follow its
    decisions (their float rounding may differ, and every rank must run the same passes)."""
    import math

    import numpy as np
    import torch
    from tqdm import tqdm

    from strop.data.tokenizer import load_tokenizer
    from strop.model.policy import load_model, save_model
    from strop.report import MetricsLog, plot_metrics
    from strop.tracking import open_tracker
    from strop.train.device import Precision, peak_memory_mib
    from strop.train.parallel import whole
    from strop.train.sft_data import sft_data
    from strop.train.shard_load import load_policy

    s = cfg.sft
    out = cfg.run_dir / "sft"
    main = ranks.rank == 0
    # sharded: built on meta, each rank reads its shards; on the ranks' device either way
    model = load_policy(base_dir, ranks, cfg.trainer.activation_checkpointing, cfg.trainer.frozen_layers)
    precision = Precision.of(cfg.trainer, ranks.device.type)
    tokenizer = load_tokenizer(base_dir)
    pad_id = tokenizer.pad_token_id
    data = sft_data(cfg, tokenizer, out / "demos.jsonl")  # demonstrations, logged traces, or both
    val = data.val

    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay)
    warmup = max(1, s.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup, lambda: s.max_steps, s.min_lr_ratio))
    rng = np.random.default_rng(cfg.run.seed)
    log = MetricsLog(out / "metrics.jsonl", open_tracker(cfg, "sft"))
    if main:
        log.reset()

    clock = {"val_s": 0.0, "save_s": 0.0}

    def evaluate() -> float:
        """Held-out loss (every rank runs every batch: a sharded forward is a collective), rank 0's."""
        t_val = time.perf_counter()
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(val), s.batch_size):
                with precision.autocast(ranks.device):
                    loss, n = masked_nll(model, val[i : i + s.batch_size], pad_id)
                total, count = total + loss.item() * n, count + n
        model.train()
        clock["val_s"] += time.perf_counter() - t_val
        return ranks.broadcast(total / max(1, count))

    def snapshot() -> dict:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def save(extra: dict) -> None:
        """The model whole, in HF format (gathered into an unsharded copy when sharded)."""
        whole_state = {k: whole(v) for k, v in model.state_dict().items()}  # every rank: a collective
        if not main:
            return
        plain = model
        if ranks.size > 1 or ranks.device.type != "cpu":  # saved from an unsharded host copy
            plain = load_model(base_dir)
            plain.load_state_dict(whole_state)
        save_model(plain, tokenizer, out / "model", extra=extra)

    t_loop = time.perf_counter()
    best_loss, best_state, best_step, bad_evals = evaluate(), snapshot(), 0, 0
    if main:
        log.write({"step": 0, "val_loss": best_loss})
    model.train()
    bar = tqdm(total=s.max_steps, desc="sft", unit="step", dynamic_ncols=True, disable=not main)
    t0, tokens, step = time.perf_counter(), 0, 0
    for step in range(1, s.max_steps + 1):
        batch = data.batch(rng)
        mine = ranks.share(batch, lambda seg: seg)
        n_tokens = sum(sum(seg.loss_mask[1:]) for seg in batch)
        with precision.autocast(ranks.device):
            loss = summed_nll(model, [seg for seg, _ in mine], [counted for _, counted in mine], pad_id) / n_tokens
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if s.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        optimizer.step()
        scheduler.step()
        tokens += sum(len(seg.input_ids) for seg in batch)
        row = {"step": step, "loss": sum(ranks.gather(loss.item())), "tok_s": tokens / (time.perf_counter() - t0)}
        if step % s.eval_every == 0:
            row["val_loss"] = evaluate()
            if row["val_loss"] < best_loss - 1e-4:
                best_loss, best_state, best_step, bad_evals = row["val_loss"], snapshot(), step, 0
                # on disk at once: a run killed later still leaves its best policy to evaluate or keep
                t_save = time.perf_counter()
                save({"sft": {"step": step, "val_loss": best_loss, "finished": False}})
                clock["save_s"] += time.perf_counter() - t_save
            else:
                bad_evals += 1
        if main:
            log.write(row)
        bar.set_postfix(loss=f"{row['loss']:.3f}", best_val=f"{best_loss:.3f}")
        bar.update(1)
        if bad_evals >= s.patience:
            break
    bar.close()
    log.close()
    loop_s = time.perf_counter() - t_loop
    model.load_state_dict(best_state)
    model.eval()
    result = {
        **data.figures,
        "steps": step,
        "best_step": best_step,
        "early_stopped": bad_evals >= s.patience,
        "val_loss": best_loss,
        "val_ppl": math.exp(best_loss),
        "ranks": ranks.size,
        "device": ranks.device.type,
        "peak_mem_mib": peak_memory_mib(ranks.device),  # rank 0's
        # the loop's seconds: training steps, held-out loss evaluations, saving the best weights
        "train_s": round(loop_s - clock["val_s"] - clock["save_s"], 1),
        **{k: round(v, 1) for k, v in clock.items()},
    }
    save({"config": to_dict(cfg), "sft": result})
    if main:
        plot_metrics(
            log.read(), out / "loss.png", ["loss", "val_loss"], title="SFT loss on demonstration tokens (nats)"
        )
        write_atomic(out / "result.json", json.dumps(result, indent=2))
    return result
