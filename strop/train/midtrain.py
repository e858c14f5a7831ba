"""Mid-training: continued pretraining of a policy on code tokens.

Corpus -> tokenizer (trained here unless the base model brings one) -> packed windows ->
next-token loss + MoE load-balancing loss, AdamW on fp32 master weights, warmup + cosine,
gradient clipping. Checkpoints are atomic and resume exactly: a killed run rerun with the same
command ends with bit-identical weights (same seed, same thread count, one process).

With `trainer.parallel.fsdp = N` the model is sharded over N ranks (`strop.train.parallel`): each
computes its rows' part of every batch's loss, the load-balancing term's expert fractions summed
over the ranks, so the ranks' gradients add up to one process's (float rounding aside); each
rank writes its own shards of a checkpoint, and a checkpoint resumes at any rank count.

It computes where `[trainer]` says (`strop.train.device`): on the CPU or a GPU per rank, in fp32 or
under bf16 autocast over fp32 master weights, with activation checkpointing as an option.

Outputs in the run directory: `tokenizer/`, `tokens.npy` (cached train stream), `ckpt/`
(resumable, `strop.checkpoint`), `model/` (final, HF format), `metrics.jsonl`, `loss.png`, `config.toml`.
"""

import io
import time
from pathlib import Path

from strop.config import Config, to_dict, to_toml
from strop.outputs import atomic_dir, write_atomic
from strop.train.schedule import warmup_cosine


def prepare_tokenizer(cfg: Config, corpus, run_dir: Path):
    """The base model's tokenizer when starting from a real base; else one trained on the corpus."""
    from strop.data.tokenizer import load_tokenizer, train_tokenizer

    if cfg.model.path:
        return load_tokenizer(cfg.model.path)
    tok_dir = run_dir / "tokenizer"
    if (tok_dir / "tokenizer.json").is_file():
        return load_tokenizer(tok_dir)
    tokenizer = train_tokenizer(corpus.train, cfg.data.vocab_size, cfg.data.tokenizer_sample_bytes)
    with atomic_dir(tok_dir) as tmp:  # the cache is trusted on resume: whole or absent
        tokenizer.save_pretrained(str(tmp))
    return tokenizer


def steps_for_budget(cfg: Config, step_s: float, spent_s: float) -> int:
    """How many steps fit in midtrain.budget_s, given the measured step time and what is spent."""
    m = cfg.midtrain
    return max(m.probe_steps, min(m.steps, m.probe_steps + int((m.budget_s - spent_s) / step_s)))


def lm_loss(model, batch, aux_coef: float, ranks=None):
    """This rank's part of the loss of `batch` [B, T + 1]: mean next-token cross-entropy (nats) over
    the whole batch and the MoE load-balancing term, each computed on the rank's rows (every
    size-th from its rank on), so that the parts add up over the ranks to the whole batch's loss.
    One process (`ranks` None) has every row: the whole batch's loss."""
    import torch.nn.functional as F

    from strop.model.policy import is_moe, load_balancing_loss
    from strop.train.parallel import Ranks

    ranks = ranks or Ranks()
    rows = batch[ranks.rank :: ranks.size]
    inputs, targets = rows[:, :-1], rows[:, 1:]
    moe = bool(is_moe(model)) and aux_coef > 0
    out = model(input_ids=inputs, output_router_logits=moe, use_cache=False)
    ce = F.cross_entropy(out.logits.flatten(0, 1).float(), targets.flatten(), reduction="sum") / batch[:, 1:].numel()
    if not moe:
        return ce, ce.new_zeros(())
    sigmoid = model.config.model_type == "deepseek_v3"
    aux = load_balancing_loss(
        out.router_logits, model.config.num_experts_per_tok, sigmoid=sigmoid, all_sum=ranks.all_sum
    )
    return ce, aux


def midtrain(cfg: Config, stop_after: int | None = None) -> dict:
    """Run (or resume) mid-training; returns the final figures. `stop_after` ends the process's
    work after that many steps without finishing (tests use it to simulate a kill). With
    `trainer.parallel.fsdp = N > 1` this process is rank 0 of N ranks that train one model sharded
    between them (the others are worker processes it starts, the cores split between them)."""
    import numpy as np

    from strop.data.corpus import load_corpus
    from strop.data.packing import tokenize_documents
    from strop.errors import UserError
    from strop.threads import set_threads
    from strop.train.device import device_type, rank_device
    from strop.train.parallel import Ranks, start_ranks, stop_ranks

    kind = device_type(cfg.trainer)  # before any work: cuda where there is none is the user's to fix
    n = cfg.trainer.parallel.fsdp
    m = cfg.midtrain
    if m.batch_size < n:
        raise UserError(
            f"config key 'midtrain.batch_size' ({m.batch_size}) is below trainer.parallel.fsdp ({n}): "
            "every rank needs a row of each batch"
        )
    threads = set_threads(max(1, set_threads(cfg.run.threads or None) // n))
    run_dir = cfg.run_dir / "midtrain"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))

    corpus = load_corpus(cfg.data)
    tokenizer = prepare_tokenizer(cfg, corpus, run_dir)
    tok_cache = run_dir / "tokens.npy"
    if not tok_cache.is_file():  # a margin over what the run can consume, so windows are rarely seen twice
        tokens = tokenize_documents(
            tokenizer, corpus.train, limit=2 * m.steps * m.batch_size * cfg.data.seq_len, seed=cfg.run.seed
        )
        buf = io.BytesIO()
        np.save(buf, tokens)
        write_atomic(tok_cache, buf.getbuffer())  # trusted on resume: whole or absent
    val_tokens = tokenize_documents(tokenizer, corpus.val)
    args = (cfg, tokenizer, val_tokens, stop_after, threads)
    if n == 1:
        return fit(Ranks(device=rank_device(kind)), *args)
    ranks, procs = start_ranks(n, fit, args, threads, kind)
    try:
        return fit(ranks, *args)
    finally:
        stop_ranks(procs)


def fit(ranks, cfg: Config, tokenizer, val_tokens, stop_after: int | None, threads: int) -> dict:
    """The mid-training loop, run by every rank of `ranks` on the same batches (each computes its
    rows' part of the loss, `lm_loss`); rank 0 logs, evaluates and writes the model, every rank
    writes its shards of each checkpoint (`strop.train.sharded_checkpoint.save_training`)."""
    import numpy as np
    import torch
    from tqdm import tqdm

    from strop.checkpoint import find_checkpoint
    from strop.data.packing import PackedBatches
    from strop.model.policy import build_model, load_model, save_model
    from strop.report import MetricsLog, plot_metrics
    from strop.tracking import open_tracker
    from strop.train.device import Precision, checkpoint_activations, peak_memory_mib
    from strop.train.parallel import shard_model, whole
    from strop.train.shard_load import load_policy
    from strop.train.sharded_checkpoint import load_training, save_training

    run_dir = cfg.run_dir / "midtrain"
    m = cfg.midtrain
    main = ranks.rank == 0
    tokens_per_step = m.batch_size * cfg.data.seq_len
    data = PackedBatches(np.load(run_dir / "tokens.npy"), cfg.data.seq_len, m.batch_size, cfg.run.seed)
    val = PackedBatches(val_tokens, cfg.data.seq_len, m.batch_size, cfg.run.seed)

    if cfg.model.path:  # sharded: built on meta, each rank reads its shards
        model = load_policy(cfg.model.path, ranks, cfg.trainer.activation_checkpointing, cfg.trainer.frozen_layers)
    else:  # a new model: built whole on every rank (the same seed), then sharded
        model = build_model(cfg.model, tokenizer, cfg.run.seed).to(ranks.device)
        if cfg.trainer.activation_checkpointing:
            checkpoint_activations(model)
        if ranks.size > 1:
            shard_model(model, ranks.mesh)
    model.train()
    precision = Precision.of(cfg.trainer, ranks.device.type)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": m.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=m.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    total = {"steps": m.steps, "chosen": m.budget_s == 0}
    schedule = warmup_cosine(m.warmup_steps, lambda: total["steps"], m.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    ckpt = run_dir / "ckpt"
    step, elapsed_before = 0, 0.0
    log = MetricsLog(run_dir / "metrics.jsonl", open_tracker(cfg, "midtrain"))
    found = ranks.broadcast(find_checkpoint(ckpt))  # rank 0's finding: a checkpoint being replaced is not seen twice
    if found is not None:
        state = load_training(found, model, optimizer, scheduler, ranks)
        step, elapsed_before = state["step"], state.get("elapsed_s", 0.0)
        total.update(steps=state.get("total_steps", m.steps), chosen=state.get("total_chosen", True))
        if main:
            log.truncate_after(step)
    else:
        if main:
            log.reset()
        torch.manual_seed(cfg.run.seed)

    def evaluate() -> float:
        """Held-out loss; every rank runs every batch whole (a sharded forward is a collective)."""
        model.eval()
        with torch.no_grad():
            with precision.autocast(ranks.device):
                losses = [
                    lm_loss(model, torch.from_numpy(val.batch_at(i)).to(ranks.device), 0.0)[0].item()
                    for i in range(m.eval_batches)
                ]
        model.train()
        return ranks.broadcast(float(np.mean(losses)))

    bar = tqdm(total=total["steps"], initial=step, desc="midtrain", unit="step", dynamic_ncols=True, disable=not main)
    t_start, steps_here, step_times = time.perf_counter(), 0, []
    while step < total["steps"]:
        if stop_after is not None and steps_here >= stop_after:
            bar.close()
            return {"stopped_at": step}
        t0 = time.perf_counter()
        batch = torch.from_numpy(data.batch_at(step)).to(ranks.device)
        with precision.autocast(ranks.device):
            ce, aux = lm_loss(model, batch, cfg.model.router_aux_loss_coef, ranks)
        loss = ce + cfg.model.router_aux_loss_coef * aux
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = whole(
            torch.nn.utils.clip_grad_norm_(model.parameters(), m.grad_clip if m.grad_clip > 0 else float("inf"))
        )
        optimizer.step()
        scheduler.step()
        step += 1
        steps_here += 1
        dt = time.perf_counter() - t0
        step_times.append(dt)
        if not total["chosen"] and step >= m.probe_steps and len(step_times) >= 2:
            # the first step pays one-off costs; time the later probe steps
            step_s = float(np.median(step_times[1:]))
            total.update(
                steps=steps_for_budget(cfg, step_s, elapsed_before + time.perf_counter() - t_start), chosen=True
            )
            total["steps"] = ranks.broadcast(total["steps"])  # rank 0's clock decides for every rank
            bar.total = total["steps"]
        ce_sum, aux_sum = map(sum, zip(*ranks.gather((ce.item(), aux.item()))))
        row = {
            "step": step,
            "loss": ce_sum,
            "aux": aux_sum,
            "grad_norm": grad_norm.item(),
            "lr": scheduler.get_last_lr()[0],
            "tok_s": tokens_per_step / dt,
        }
        if step % m.eval_every == 0 or step == total["steps"]:
            row["val_loss"] = evaluate()
        if main:
            log.write(row)
        bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tok_s']:.0f}")
        bar.update(1)
        if step % m.ckpt_every == 0 or step == total["steps"]:
            elapsed = elapsed_before + time.perf_counter() - t_start
            save_training(
                ckpt,
                model,
                optimizer,
                scheduler,
                step,
                {"elapsed_s": elapsed, "total_steps": total["steps"], "total_chosen": total["chosen"]},
                ranks,
            )
    bar.close()
    log.close()

    whole_state = {k: whole(v) for k, v in model.state_dict().items()}  # every rank: a collective
    if not main:
        return {}
    rows = log.read()
    plot_metrics(rows, run_dir / "loss.png", ["loss", "val_loss"], title="mid-training loss (nats/token)")
    val_rows = [r for r in rows if "val_loss" in r]
    result = {
        "steps": step,
        "tokens": step * tokens_per_step,
        "train_s": round(elapsed_before + time.perf_counter() - t_start, 1),
        "train_loss": float(np.mean([r["loss"] for r in rows[-20:]])) if rows else None,
        "val_loss": val_rows[-1]["val_loss"] if val_rows else None,
        "tok_s": float(np.median([r["tok_s"] for r in rows])) if rows else None,
        "threads": threads,
        "ranks": ranks.size,
        "device": ranks.device.type,
        "precision": "bf16" if precision.bf16 else "fp32",
        "peak_mem_mib": peak_memory_mib(ranks.device),  # rank 0's
        "params": sum(p.numel() for p in model.parameters()),  # whole sizes, sharded or not
    }
    plain = model.cpu() if ranks.size == 1 else model  # saved from the host
    if ranks.size > 1:  # an unsharded copy holding the gathered weights, to save in HF format
        plain = load_model(cfg.model.path) if cfg.model.path else build_model(cfg.model, tokenizer, cfg.run.seed)
        plain.load_state_dict(whole_state)
    plain.eval()
    save_model(plain, tokenizer, run_dir / "model", extra={"config": to_dict(cfg), "midtrain": result})
    return result
