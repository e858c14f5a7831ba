"""What a run directory holds and what each metric means: the tables the docs' run-directory reference
is generated from. `tests/test_rollouts_kept.py` and `tests/test_tracking.py` check that every key a
real run writes to `metrics.jsonl` is named here, so the reference cannot fall behind the code.
"""

import re

# (path under runs/<run.name>/, what writes it, what it holds)
RUN_FILES: list[tuple[str, str, str]] = [
    ("summary.json", "strop demo", "one object per finished stage: its key figures and wall_s (a rerun skips those)"),
    ("report.md, *.png", "strop demo", "the run report: held-out table, gains, behaviour, curves, rollouts"),
    ("midtrain/tokenizer/", "strop midtrain", "the BPE tokenizer trained on the corpus"),
    ("midtrain/tokens.npy", "strop midtrain", "the packed training tokens"),
    ("midtrain/ckpt/", "strop midtrain", "the resumable checkpoint (model, optimizer, scheduler, step, RNG)"),
    ("midtrain/model/", "strop midtrain", "the mid-trained policy in Hugging Face format"),
    ("midtrain/metrics.jsonl, loss.png, config.toml", "strop midtrain", "metrics per step, the loss plot, the config"),
    ("sft/demos.jsonl", "strop sft", "the oracle's demonstration episodes (cached)"),
    ("sft/model/", "strop sft", "the best held-out policy, written at every improvement"),
    ("sft/metrics.jsonl, *.png", "strop sft", "metrics per step and their plots"),
    ("sft/eval.json, sft/rollouts/", "strop demo", "the warm start's held-out evaluation and its kept episodes"),
    ("rl/metrics.jsonl", "strop train", "one row per RL step (the RL metrics below)"),
    ("rl/report.md, rl/*.png", "strop train", "the RL report and its plots"),
    (
        "rl/rollouts/step_NNNNNN.jsonl.gz",
        "strop train",
        "each step's trajectories (`strop runs show`), within log.rollouts_max_mb",
    ),
    ("rl/rollouts/eval_greedy.jsonl.gz, eval_sampled.jsonl.gz", "strop demo", "the held-out evaluation's episodes"),
    ("rl/checkpoint/", "strop train", "the whole run every rollout.ckpt_every steps: rerunning the command resumes"),
    ("rl/weights/", "strop train", "the versioned weight store the engines sync from (unless sync.store is set)"),
    ("rl/snapshots/", "strop train", "the last two published bf16 snapshots"),
    ("rl/model/, rl/result.json, rl/config.json", "strop train", "the final policy, the run's figures, its config"),
    ("rl/eval.json", "strop demo", "the RL policy's held-out evaluation"),
    ("wandb/", "[log] wandb", "W&B runs (offline mode keeps them here for `wandb sync`)"),
    ("tensorboard/<stage>/", "[log] tensorboard", "TensorBoard event files"),
    ("mlruns/", "[log] mlflow", "the MLflow file store (unless log.mlflow_uri names another)"),
]

METRICS: dict[str, dict[str, str]] = {
    "midtrain": {
        "step": "optimizer step",
        "loss": "cross-entropy of the step's batch (nats/token)",
        "aux": "MoE load-balancing loss",
        "grad_norm": "gradient norm before clipping",
        "lr": "learning rate after the step",
        "tok_s": "training tokens per second",
        "val_loss": "held-out loss (every midtrain.eval_every steps)",
    },
    "sft": {
        "step": "optimizer step (0: the base before training)",
        "loss": "loss on the demonstrations' assistant tokens (nats/token)",
        "tok_s": "tokens per second",
        "val_loss": "held-out demonstrations' loss (every sft.eval_every steps); the best is kept",
    },
    "rl": {
        "step": "RL step (policy versions published)",
        "mode": "async or sync",
        "version": "policy version after the step",
        "loss": "the step's loss",
        "grad_norm": "gradient norm before clipping",
        "samples": "trajectories trained on",
        "reward": "mean checker reward of the step's trajectories",
        "train_reward": "mean training reward (after penalties, shaping, placebo)",
        "solve_rate": "share of the step's trajectories that solved their task",
        "solve_rate_d<N>": "share of the step's trajectories of difficulty N that solved their task",
        "hacked": "trajectories flagged by the hack monitor this step",
        "hacked_total": "flagged trajectories so far",
        "hack_kinds": "flags by kind this step (degenerate = invalid-call loops, stalls, questions)",
        "k3": "k3 estimate of KL(behaviour || trainer) over generated tokens",
        "ref_kl": "k3 KL to the reference policy (rl.ref_kl_coef)",
        "clip_frac": "share of tokens whose ratio the PPO clip held",
        "mask_frac": "share of tokens masked by the off-policy correction (icepop, geo_mask)",
        "trunc_frac": "share of tokens whose importance weight was truncated (tis)",
        "ratio_mean": "mean trainer/behaviour probability ratio",
        "mismatch_mean_abs_dlogp": "mean |trainer - engine| logprob of sampled tokens",
        "mismatch_max_abs_dlogp": "largest |trainer - engine| logprob",
        "mismatch_ratio_outside_frac": "share of tokens whose ratio is outside [0.5, 2]",
        "mismatch_bitwise_equal_frac": "share of tokens whose logprobs agree bit for bit",
        "mismatch_routing_flip_rate": "share of MoE routing decisions the trainer made differently (without replay)",
        "gen_tokens": "generated tokens trained on",
        "no_signal_frac": "share of rows with advantage 0 (no learning signal)",
        "tokens": "every position trained on, context included",
        "tokens_per_s": "trainer tokens per second",
        "staleness_max": "largest version lag of a trained sample",
        "staleness_hist": "trained samples by version lag",
        "step_s": "trainer seconds for the step",
        "publish_s": "seconds to publish the new version to the weight store",
        "peak_mem_mib": "rank 0's peak memory: GPU memory allocated, or the process's RSS",
        "update_rel": "size of the update relative to the weights (every rl.measure_every steps)",
        "objective_gain": "how much the step raised its own objective; negative: the update overshot",
        "dlogp_pos": "mean logprob change of sampled tokens with positive advantage",
        "dlogp_neg": "mean logprob change of sampled tokens with negative advantage",
        "groups": "groups trained on",
        "mixed_groups": "share of groups whose samples got different advantages",
        "behaviour_retry_after_rejected_edit": "share of rejected edits retried (strop.env.grading.behaviour)",
        "behaviour_rejected_edit": "share of episodes with a rejected edit",
        "behaviour_test_runs": "test runs per episode",
        "behaviour_submitted_untested": "share of episodes submitted without running the tests",
        "behaviour_turns": "assistant turns per episode",
        "dropped": "samples dropped so far, by reason",
        "dropped_stale": "samples dropped as stale so far",
        "relaunched": "rollouts relaunched after a lost engine or worker",
        "lost": "rollouts given up on",
        "rollout_tokens_per_s": "generated tokens per second since the last step",
        "trainer_busy": "share of wall time the trainer was computing",
        "engine_busy": "share of wall time the engines were decoding",
        "bytes_synced": "bytes the trainer's origin sent to the engines so far",
        "wall_s": "wall seconds since the run started (resumes included)",
    },
}


def undocumented(stage: str, rows: list[dict]) -> list[str]:
    """Keys of a stage's metrics rows that METRICS does not name (a key per difficulty, `name_d3`,
    is named by `name_d<N>`)."""
    keys = {re.sub(r"_d\d+$", "_d<N>", k) for r in rows for k in r}
    return sorted(keys - METRICS[stage].keys())
