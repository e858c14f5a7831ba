"""Typed run configs: one schema (`Config`) for every role, loaded from TOML and `--set` overrides.

Every field carries its help text and bounds in `field(metadata=...)`. Loading refuses unknown
keys, wrong types and out-of-range values with the key's dotted name (a `UserError`, so the CLI
prints one line and exits 2). The resolved config is written into each run directory.
"""

import argparse
import dataclasses
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from strop.errors import UserError


def opt(
    default: Any,
    help: str,
    *,
    ge: float | None = None,
    le: float | None = None,
    gt: float | None = None,
    nonempty: bool = False,
    advanced: bool = False,
) -> Any:
    """A config field with help text and optional numeric bounds; `nonempty` refuses an empty list.
    `advanced` marks a knob for experiments (controls, the demonstrator mixture's internals, shaping
    the README's sweeps used) that a user's run leaves at its default; the reference lists it apart."""
    meta = {"help": help, "ge": ge, "le": le, "gt": gt, "nonempty": nonempty, "advanced": advanced}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=-]{0,99}")  # one directory name, never a path


@dataclass
class RunSection:
    name: str = opt("run", "run name; outputs go to out_dir/name")
    out_dir: str = opt("runs", "directory that holds run directories")
    seed: int = opt(0, "global seed", ge=0)
    threads: int = opt(0, "torch intra-op threads; 0 = all cores", ge=0)

    def __post_init__(self) -> None:
        # The name becomes a directory that `strop demo --fresh` deletes: a path ("", ".", "..",
        # "a/b") would make that out_dir itself, its parent or another folder.
        if not RUN_NAME.fullmatch(self.name):
            raise UserError(
                f"config key 'run.name' ({self.name!r}) must be one directory name: letters, digits "
                "and . _ + - = (at most 100, not starting with '.' or '-')"
            )


@dataclass
class ModelSection:
    path: str = opt("", "local HF model directory to start from; empty = build a tiny model from the fields below")
    arch: Literal["qwen3_moe", "deepseek_v3", "qwen3"] = opt("qwen3_moe", "HF architecture for a tiny model")
    hidden_size: int = opt(128, "model width", ge=8)
    num_layers: int = opt(4, "decoder layers", ge=1)
    num_heads: int = opt(4, "attention heads", ge=1)
    num_kv_heads: int = opt(2, "key/value heads (GQA)", ge=1)
    head_dim: int = opt(32, "per-head width", ge=4)
    num_experts: int = opt(32, "routed experts per MoE layer", ge=1)
    experts_per_token: int = opt(4, "top-k routing", ge=1)
    expert_size: int = opt(128, "intermediate width of one expert", ge=4)
    dense_size: int = opt(512, "intermediate width of dense MLPs (qwen3, shared experts)", ge=4)
    max_positions: int = opt(2048, "longest context", ge=16)
    router_aux_loss_coef: float = opt(0.01, "MoE load-balancing loss weight", ge=0)


@dataclass
class DataSection:
    stdlib: bool = opt(True, "include the running interpreter's standard library source")
    dirs: list[str] = opt([], "extra directories of source files")
    jsonl: list[str] = opt([], "extra JSONL files with a 'text' field per line")
    extensions: list[str] = opt([".py"], "file extensions taken from directories")
    val_files: int = opt(40, "files held out for validation (the last by path order)", ge=1)
    max_file_bytes: int = opt(200_000, "skip larger files (generated or data files)", ge=100)
    vocab_size: int = opt(4096, "BPE vocabulary size", ge=300)
    tokenizer_sample_bytes: int = opt(8_000_000, "bytes of training text used to train the tokenizer", ge=1000)
    seq_len: int = opt(256, "packed sequence length", ge=8)


@dataclass
class MidtrainSection:
    steps: int = opt(2000, "optimizer steps (an upper bound when budget_s is set)", ge=1)
    batch_size: int = opt(16, "sequences per step", ge=1)
    lr: float = opt(3e-3, "peak learning rate", gt=0)
    min_lr_ratio: float = opt(0.1, "final lr as a fraction of peak (cosine)", ge=0, le=1)
    warmup_steps: int = opt(100, "linear warmup steps", ge=0)
    weight_decay: float = opt(0.1, "AdamW weight decay", ge=0)
    grad_clip: float = opt(1.0, "gradient norm clip; 0 = off", ge=0)
    ckpt_every: int = opt(200, "save a resumable checkpoint every N steps", ge=1)
    eval_every: int = opt(200, "held-out loss every N steps", ge=1)
    eval_batches: int = opt(8, "batches per held-out evaluation", ge=1)
    budget_s: float = opt(
        0.0,
        "fit the run into this many seconds: the step count is chosen from the speed of the "
        "first steps (and kept on resume), so the schedule still anneals; 0 = use steps",
        ge=0,
    )
    probe_steps: int = opt(4, "steps timed to choose the step count under budget_s", ge=2)


@dataclass
class SFTSection:
    suite: str = opt("synthetic", "task suite whose oracle demonstrations are the warm-start data")
    episodes: int = opt(400, "oracle demonstration episodes (the last val_fraction are held out)", ge=2)
    demo_tests: bool = opt(
        True,
        "careful demonstrators run the visible tests before submitting (one pytest run per episode)",
        advanced=True,
    )
    demo_check: bool = opt(
        True,
        "keep only demonstrations the checker scores 1.0 (else: every one that submitted, "
        "as unfiltered logs hold them: a careless demonstrator's failures included)",
        advanced=True,
    )
    careful: float = opt(
        1.0,
        "share of demonstrators that read each tool result, retry a rejected edit and run the "
        "visible tests; the rest submit whatever they have (see strop.env.demonstrators.runs). On `chain`, the "
        "rest summarize only the last stages' keys and submit what they kept (strop.env.demonstrators.chain)",
        ge=0,
        le=1,
        advanced=True,
    )
    suspects: float = opt(
        0.0,
        "share of demonstrators that, instead of finding the bug by reading, try the function's "
        "known bugs in the usual order, so attempts ahead of the injected one are rejected",
        ge=0,
        le=1,
        advanced=True,
    )
    misremember: float = opt(
        0.0,
        "chance that a demonstrator misremembers the text of the line it fixes, so edit_file "
        "rejects that attempt and shows the closest text",
        ge=0,
        le=1,
        advanced=True,
    )
    max_wrong: int = opt(
        2,
        "most rejected attempts a careful demonstrator makes before the right edit (keep it below "
        "rollout.max_invalid_turns: that many rejected turns in a row end an episode)",
        ge=1,
        advanced=True,
    )
    demo_workers: int = opt(4, "oracle episodes run at once while producing demonstrations", ge=1)
    difficulties: list[int] = opt([], "task difficulties the demonstrations cover (e.g. those RL trains on); [] = all")
    val_fraction: float = opt(0.1, "fraction of demonstrations held out for early stopping", gt=0, le=0.5)
    train_summaries: bool = opt(
        True,
        "train on the summaries the demonstrator wrote at its context resets; false keeps them in the "
        "context but out of the loss: a policy that acts on summaries but was never taught to write one",
    )
    traces: str = opt(
        "",
        "JSONL of logged sessions to train on, one OpenAI-format chat conversation with tool calls a line "
        "(what `strop agent --log-session` writes); empty = none (strop.train.traces)",
    )
    trace_share: float = opt(
        0.5,
        "with traces: the share of training segments drawn from them, the rest from demonstrations; "
        "1 = traces only (no demonstrator runs)",
        ge=0,
        le=1,
    )
    max_traces: int = opt(
        20000,
        "the most conversations read from sft.traces (the first ones; the rest of the file is not read, and "
        "a line far longer than the model's context is skipped unread): a huge log stays within memory",
        ge=2,
    )
    batch_size: int = opt(8, "segments per step", ge=1)
    lr: float = opt(1e-3, "peak learning rate", gt=0)
    warmup_steps: int = opt(20, "linear warmup steps", ge=0)
    max_steps: int = opt(2000, "upper bound on optimizer steps; early stopping usually ends sooner", ge=1)
    min_lr_ratio: float = opt(
        1.0, "lr at max_steps as a fraction of the peak, reached by a cosine after warmup (1 = constant)", ge=0, le=1
    )
    eval_every: int = opt(25, "held-out demonstration loss every N steps", ge=1)
    patience: int = opt(4, "stop after this many evaluations without improvement", ge=1)
    weight_decay: float = opt(0.0, "AdamW weight decay", ge=0)
    grad_clip: float = opt(1.0, "gradient norm clip; 0 = off", ge=0)


@dataclass
class RLSection:
    group_size: int = opt(8, "samples per task (G); advantages are relative to the group", ge=2)
    batch_groups: int = opt(4, "groups per optimizer step", ge=1)
    steps: int = opt(200, "optimizer steps (policy versions published)", ge=1)
    max_staleness: int = opt(
        2,
        "never train on a sample whose oldest token is more than this many versions behind the trainer; 0 = on-policy",
        ge=0,
    )
    max_inflight: int = opt(
        0,
        "samples admitted but not yet trained (running + buffered); "
        "0 = batch_groups * group_size * (max_staleness + 1)",
        ge=0,
    )
    lr: float = opt(1e-4, "AdamW learning rate (constant)", gt=0)
    weight_decay: float = opt(0.0, "AdamW weight decay", ge=0)
    grad_clip: float = opt(1.0, "gradient norm clip; 0 = off", ge=0)
    micro_batch: int = opt(8, "segments per forward/backward; gradients accumulate over the step", ge=1)
    clip_low: float = opt(0.2, "PPO clip: no gradient pushing the ratio to behavior below 1 - clip_low", ge=0, le=1)
    clip_high: float = opt(0.28, "PPO clip: no gradient pushing the ratio to behavior above 1 + clip_high", ge=0)
    correction: Literal["none", "tis", "icepop", "geo_mask"] = opt(
        "tis", "off-policy correction: truncated importance sampling, token masking, or geometric sequence masking"
    )
    tis_cap: float = opt(2.0, "tis: importance weights are capped at this value", gt=0)
    mask_low: float = opt(0.5, "icepop: tokens whose ratio to behavior is below this are masked", ge=0)
    mask_high: float = opt(5.0, "icepop: tokens whose ratio to behavior is above this are masked", gt=0)
    geo_low: float = opt(0.8, "geo_mask: a segment whose geometric-mean ratio is below this is masked", ge=0)
    geo_high: float = opt(1.25, "geo_mask: a segment whose geometric-mean ratio is above this is masked", gt=0)
    dr_grpo: bool = opt(False, "Dr.GRPO: no std normalisation of advantages, no per-sample length normalisation")
    dr_grpo_norm_tokens: int = opt(
        1024, "Dr.GRPO: the constant per-sample token normaliser (the generation budget)", ge=1
    )
    kl_coef: float = opt(0.0, "weight of the k3 KL to the behavior policy in the loss", ge=0)
    ref_kl_coef: float = opt(
        0.0,
        "weight of the k3 KL to the reference policy (the warm start, `--policy`) in the loss: an anchor "
        "that pulls back drift no reward asks for; > 0 costs one more forward pass per micro-batch",
        ge=0,
    )
    skip_zero_advantage: bool = opt(
        True,
        "samples with advantage 0 run forward-only (their loss is exactly 0 without a KL "
        "term); false runs their backward too: same update, full cost",
    )
    idle_rows: int = opt(
        8,
        "at most this many advantage-0 rows per step run forward-only, for the mismatch metrics "
        "(every learning row is measured too); the others cost nothing",
        ge=0,
    )
    measure_every: int = opt(
        1,
        "every N steps, log the update's size relative to the weights and how far the sampled "
        "tokens' logprobs moved (one extra forward pass over the learning rows); 0 = never",
        ge=0,
    )
    placebo: bool = opt(
        False,
        "a control run: each trajectory's training reward is seeded uniform noise, so the updates keep "
        "their structure (episodes, segments, one advantage over every token) and lose the reward's "
        "signal; what such a run does to held-out quality is what the updates' noise alone does",
        advanced=True,
    )
    reward_power: float = opt(
        1.0,
        "the training reward is the checker's raised to this power (before any penalty): above 1, a "
        "partial-credit reward pays the last checks more than the first, closer to paying for the solve",
        gt=0,
        advanced=True,
    )
    solve_bonus: float = opt(
        0.0,
        "added to the training reward of a solved trajectory (every check passed): with partial credit, "
        "a group's solve then outranks its near misses by more than the one check they lack",
        ge=0,
        advanced=True,
    )
    negative_weight: float = opt(
        1.0,
        "scales the advantages of samples worse than their group's baseline; 0 reinforces only the "
        "better ones (positive-sample reinforcement), so a failed episode's right tokens are not pushed "
        "down with its wrong ones",
        ge=0,
        le=1,
        advanced=True,
    )
    curriculum: Literal["uniform", "edge"] = opt(
        "uniform",
        "how tasks are drawn: a seeded permutation per epoch, or at the policy's edge (tasks whose running "
        "solve rate is neither 0 nor 1: strop.rl.curriculum)",
    )
    curriculum_explore: float = opt(
        0.25, "edge: the share of draws that go to tasks never drawn yet (while there are any)", ge=0, le=1
    )
    curriculum_memory: float = opt(
        0.5, "edge: the weight of a task's newest group in its running solve rate", gt=0, le=1
    )
    hack_penalty: float = opt(1.0, "subtracted from the reward of a trajectory flagged with a hack", ge=0)
    degenerate_penalty: float = opt(
        0.0,
        "subtracted instead when every flag is 'degenerate' (invalid-call loops, stalling, "
        "asking): failures, not hacks; a penalty here teaches a weak policy to stop trying",
        ge=0,
    )

    def __post_init__(self) -> None:
        if self.mask_low >= self.mask_high:
            raise UserError(f"config key 'rl.mask_low' ({self.mask_low}) must be below rl.mask_high ({self.mask_high})")
        if self.geo_low >= self.geo_high:
            raise UserError(f"config key 'rl.geo_low' ({self.geo_low}) must be below rl.geo_high ({self.geo_high})")

    @property
    def inflight_limit(self) -> int:
        """Samples allowed ahead of the trainer: beyond this, new work would outrun the staleness bound."""
        return self.max_inflight or self.batch_groups * self.group_size * (self.max_staleness + 1)


ENGINE_BACKENDS = ("strop", "vllm")  # rollout.engine's names; anything else must be a URL


@dataclass
class RolloutSection:
    suite: str = opt(
        "synthetic",
        "task suite: RL samples its train split, evaluation its eval split. A built-in or installed "
        "suite's name (`strop tasks list`), a task file as jsonl:PATH, or a dotted path package.module",
    )
    image: str = opt(
        "",
        "OS image of the tasks that name none: a root directory, an OCI image layout (directory or "
        "tar) or a `docker save` archive; empty = the host's root",
    )
    difficulties: list[int] = opt(
        [1], "task difficulties RL trains on (a suite whose tasks have no difficulty is drawn once)", nonempty=True
    )
    train_tasks: int = opt(500, "train tasks per difficulty", ge=1)
    train_start: int = opt(
        0,
        "index of the first train task RL draws, per difficulty: sft.episodes leaves out the tasks the warm "
        "start's demonstrations came from, whose answers SFT can have memorized",
        ge=0,
    )
    workers: int = opt(4, "rollouts in flight at once (threads inline, actors on Ray)", ge=1)
    engines: int = opt(1, "inference engines", ge=1)
    engine: str = opt(
        "strop",
        "inference engine backend: 'strop' (strop's engine, in process), 'vllm' (a vLLM server "
        "each engine starts as a subprocess; needs `make vllm`), or the http(s):// URL of a running "
        "`strop serve --keys K --weights-store <this run's store>` (admin key in $STROP_API_KEY)",
    )
    vllm_gpu_memory: float = opt(
        0.0,
        "share of its GPU's memory a vLLM engine takes (weights, activations, KV cache; vLLM's "
        "--gpu-memory-utilization); 0 = vLLM's default (0.9). Where the trainer shares the GPU, leave it room",
        ge=0,
        le=1,
    )
    engine_batch: int = opt(16, "sequences one engine decodes together", ge=1)
    max_turns: int = opt(6, "assistant turns per episode", ge=1)
    max_context: int = opt(1024, "tokens per context window", ge=64)
    max_turn_tokens: int = opt(160, "tokens per assistant turn", ge=8)
    max_invalid_turns: int = opt(3, "consecutive turns whose every tool call was rejected end the episode", ge=1)
    context_strategy: Literal["none", "summarize", "truncation", "masking", "compaction"] = opt(
        "none",
        "when the next turn would not fit in max_context: the policy summarizes its work (trained with the "
        "episode's reward), the oldest turns are dropped, old tool outputs are masked, or a heuristic note (every "
        "tool call + the last keep_recent outputs) is carried; none = the episode ends (strop.env.harness.context)",
    )
    max_resets: int = opt(8, "context resets per episode", ge=0)
    summary_tokens: int = opt(192, "summarize: most tokens of one summary", ge=16)
    summary_tail: int = opt(0, "summarize: recent turns carried verbatim after the summary", ge=0)
    keep_recent: int = opt(2, "masking, compaction: recent tool outputs kept in full", ge=0)
    temperature: float = opt(1.0, "sampling temperature of rollouts", gt=0)
    command_timeout_s: float = opt(10.0, "wall-clock limit per sandbox command", gt=0)
    memory_mb: int = opt(
        1024,
        "address space of each process in a sandbox, MB (RLIMIT_AS): in RL and evaluation episodes, their "
        "checks and `strop agent`; a task's own memory_mb overrides it for that task",
        ge=1,
    )
    cpu_s: int = opt(
        30, "CPU seconds per sandbox command (RLIMIT_CPU), as memory_mb; a task's own cpu_s overrides it", ge=1
    )
    max_procs: int = opt(64, "processes a sandbox may hold at once", ge=1)
    file_size_mb: int = opt(64, "largest file a sandbox command may write, MB", ge=1)
    workspace_mb: int = opt(
        256, "most the changes to a sandbox's repository may take, MB (its copy-on-write layer)", ge=1
    )
    retries: int = opt(2, "times a rollout lost with its engine or worker is relaunched elsewhere", ge=0)
    ckpt_every: int = opt(1, "checkpoint the whole run every N steps", ge=1)
    eval_difficulties: list[int] = opt([1, 2], "held-out difficulties evaluated", nonempty=True)
    eval_episodes: int = opt(200, "held-out episodes per evaluated difficulty", ge=1)
    eval_temperature: float = opt(0.0, "sampling temperature of held-out evaluation; 0 = greedy", ge=0)
    eval_samples: int = opt(
        0,
        "held-out evaluation also samples every task this many times at rollout.temperature, the "
        "policy RL trains (pass@1 and pass@K beside the greedy rate); 0 = greedy only",
        ge=0,
    )

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_BACKENDS and not self.engine.startswith(("http://", "https://")):
            raise UserError(
                f"config key 'rollout.engine' ({self.engine!r}) must be one of {list(ENGINE_BACKENDS)} "
                "or the http(s):// URL of a running server"
            )


@dataclass
class HarnessSection:
    """The product's harness, as training, evaluation and `strop agent` run it (`strop.env.harness.loop`)."""

    tools: list[str] = opt(
        ["coding"],
        "the tool set: `strop.tools` entry points (coding = strop's built-in set), dotted paths "
        "package.module:attribute, .toml/.json files of command tools, new=spec to rename one "
        "(strop.env.harness.tools)",
        nonempty=True,
    )
    system: str = opt("", "system prompt ({workdir} = the repository's path in the sandbox); empty = strop's")
    system_file: str = opt("", "a file holding the system prompt, instead of system")
    chat_template: str = opt(
        "auto",
        "auto = the checkpoint's own chat template when it has one other than strop's, else strop's format; "
        "strop = strop's format; or a .jinja file (strop.env.harness.chat_formats)",
    )
    tool_parser: str = opt(
        "auto",
        "how tool calls are read from a chat template's replies: auto (told from the template; none when "
        "it shows no tool syntax), hermes, llama3_json, none (every reply is content), or a dotted path to a parser",
    )


@dataclass
class SyncSection:
    type: Literal["delta", "full"] = opt(
        "delta",
        "what each version ships to the engines: a lossless delta against the previous version, or the whole snapshot",
    )
    store: str = opt(
        "",
        "the versioned weight store: a directory or any fsspec URL (s3://..., gs://...) that every "
        "inference node can read (joins and repairs read it); empty = the RL output directory's weights/",
    )
    keep_deltas: int = opt(
        8,
        "deltas the store keeps behind the latest version (between this and twice this); older "
        "ones are folded into its snapshot (a receiver further behind fetches only the tensors that "
        "differ); 0 = keep all",
        ge=0,
    )
    wan_mb_s: float = opt(
        0.0,
        "bandwidth of each trainer-to-cluster link in MB/s, a token bucket that makes links on "
        "one machine stand for WAN links (tests, benchmarks); 0 = unshaped",
        ge=0,
        advanced=True,
    )
    lan_mb_s: float = opt(
        0.0, "bandwidth of each relay-to-engine link in MB/s (token bucket); 0 = unshaped", ge=0, advanced=True
    )


@dataclass
class ParallelSection:
    fsdp: int = opt(
        1,
        "trainer ranks the model, its gradients and its optimizer state are sharded over (torch FSDP2, "
        "gloo on CPU, NCCL on GPUs: one GPU a rank); each rank trains on its share of every step's "
        "micro-batches; 1 = one process holding the whole model",
        ge=1,
        le=256,
    )


@dataclass
class TrainerSection:
    parallel: ParallelSection = field(default_factory=ParallelSection)
    device: Literal["auto", "cpu", "cuda"] = opt(
        "auto",
        "where every trainer role (mid-training, SFT, RL) computes: auto = CUDA when torch finds a GPU "
        "(on Ray: when the trainer nodes have one GPU per rank), else the CPU; cuda where there is none is an error",
    )
    precision: Literal["auto", "fp32", "bf16"] = opt(
        "auto",
        "trainer compute precision: bf16 = matmuls under bf16 autocast, with fp32 master weights, gradients "
        "and optimizer state; fp32 = everything in fp32; auto = bf16 on CUDA, fp32 on the CPU",
    )
    activation_checkpointing: bool = opt(
        False,
        "recompute each decoder layer's activations in the backward pass instead of keeping them: "
        "less memory for about one more forward pass per step",
    )
    frozen_layers: float = opt(
        0.0,
        "fraction of the decoder layers, from the bottom, not trained (with the embeddings and a head "
        "tied to them): no backward below them, no optimizer state; 2/3 nearly halves a pretrained "
        "model's CPU step (strop.train.device.freeze_lower)",
        ge=0.0,
        le=1.0,
    )


@dataclass
class LogSection:
    """Where every stage's metrics go besides its own `metrics.jsonl` and plots, and which rollouts are
    kept. The trackers are optional extras (`pip install 'strop[wandb]'`, `[tensorboard]`, `[mlflow]`)."""

    wandb: bool = opt(
        False, "send every stage's metrics to Weights & Biases (one W&B run per stage, grouped by run.name)"
    )
    wandb_project: str = opt("strop", "W&B project")
    wandb_entity: str = opt("", "W&B entity (team or user); empty = your default entity")
    wandb_mode: Literal["online", "offline"] = opt(
        "online", "offline writes the W&B run under the run directory (`wandb sync` uploads it later)"
    )
    trajectories_every: int = opt(
        10, "W&B: a table of RL trajectories (each step's best and worst) every N steps; 0 = none", ge=0
    )
    tensorboard: bool = opt(False, "write TensorBoard event files to <run dir>/tensorboard/<stage>")
    mlflow: bool = opt(False, "log every stage's metrics to MLflow (one MLflow run per stage)")
    mlflow_uri: str = opt(
        "", "MLflow tracking URI (http://..., sqlite:///...); empty = a file store in <run dir>/mlruns"
    )
    rollouts: bool = opt(
        True,
        "keep RL's and evaluation's trajectories (messages, tool calls, rewards, hack flags, versions) as "
        "gzipped JSONL in the stage's rollouts/ directory (`strop eval policy`'s: the run's eval/rollouts/); "
        "`strop runs show` prints them",
    )
    rollouts_max_mb: float = opt(
        200.0,
        "size cap of one rollouts/ directory: past it a step keeps only its best and worst trajectory, then nothing",
        gt=0,
    )


@dataclass
class Config:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    midtrain: MidtrainSection = field(default_factory=MidtrainSection)
    sft: SFTSection = field(default_factory=SFTSection)
    rl: RLSection = field(default_factory=RLSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    harness: HarnessSection = field(default_factory=HarnessSection)
    sync: SyncSection = field(default_factory=SyncSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    log: LogSection = field(default_factory=LogSection)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name


def _check_value(key: str, value: Any, tp: Any, meta: dict) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise UserError(f"config key {key!r}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _check_value(key, value, args[0], meta)
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"config key {key!r}: expected a list, got {type(value).__name__} {value!r}")
        if meta.get("nonempty") and not value:
            raise UserError(f"config key {key!r}: the list may not be empty")
        (item_tp,) = typing.get_args(tp)
        return [_check_value(f"{key}[{i}]", v, item_tp, {}) for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if tp is bool and not isinstance(value, bool) or tp is not bool and isinstance(value, bool):
        raise UserError(f"config key {key!r}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    if not isinstance(value, tp):
        raise UserError(f"config key {key!r}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    if tp is float and not math.isfinite(value):  # TOML spells them inf and nan; no setting means either
        raise UserError(f"config key {key!r}: {value!r} is not a finite number")
    for bound, ok, word in (
        ("ge", lambda v, b: v >= b, ">="),
        ("le", lambda v, b: v <= b, "<="),
        ("gt", lambda v, b: v > b, ">"),
    ):
        b = meta.get(bound)
        if b is not None and not ok(value, b):
            raise UserError(f"config key {key!r}: {value!r} must be {word} {b}")
    return value


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        where = f"section [{prefix.rstrip('.')}]" if prefix else "the top level"
        raise UserError(f"unknown config key {prefix + unknown[0]!r} in {where}; known: {sorted(names)}")
    kwargs = {}
    for name, value in data.items():
        tp, key = hints[name], prefix + name
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise UserError(f"config key {key!r} is a section; expected a table")
            kwargs[name] = _build(tp, value, key + ".")
        else:
            kwargs[name] = _check_value(key, value, tp, dict(names[name].metadata))
    return cls(**kwargs)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise UserError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is a string: --set run.name=foo
    return key.strip().split("."), value


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults < TOML file < `--set key=value` overrides, validated as a whole."""
    data: dict = {}
    if path:
        p = Path(path)
        if p.is_dir():
            raise UserError(f"config file {str(p)!r} is a directory; pass a .toml file")
        if not p.exists():
            raise UserError(f"config file {str(p)!r} does not exist")
        if not p.is_file():  # a device or fifo: read without end, or blocking
            raise UserError(f"config file {str(p)!r} is not a regular file")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except OSError as e:
            raise UserError(f"config file {str(p)!r} cannot be read: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise UserError(f"config file {str(p)!r} is not UTF-8 text (byte {e.start})") from None
        except tomllib.TOMLDecodeError as e:
            raise UserError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    for text in overrides:
        keys, value = _parse_override(text)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise UserError(f"--set {text!r}: {k!r} is not a section")
        node[keys[-1]] = value
    return _build(Config, data, "")


def from_dict(data: dict) -> Config:
    """A validated config from plain data (e.g. the copy saved beside a checkpoint)."""
    return _build(Config, data, "")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dotted(d: dict, prefix: str = "") -> dict:
    """A nested config dict as {"section.key": value} (lists stay values)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(dotted(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def to_toml(cfg: Config) -> str:
    """Render a config as TOML (sections of scalars and lists, and sections nested in them)."""
    lines: list[str] = []

    def section(name: str, values: dict) -> None:
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items() if not isinstance(v, dict))
        lines.append("")
        for k, v in values.items():
            if isinstance(v, dict):
                section(f"{name}.{k}", v)

    for name, values in to_dict(cfg).items():
        section(name, values)
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The two flags every config-driven command takes."""
    parser.add_argument("--config", "-c", help="TOML run config (defaults apply where it is silent)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set midtrain.steps=100 (repeatable)",
    )


def config_from_args(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.overrides)
