#!/usr/bin/env bash
# The prepared GPU check (issues 19 and 47). On one machine with an NVIDIA GPU:
#
#   scripts/gpu_check.sh [OUT_DIR]            # default OUT_DIR: runs/gpu_check
#
# 1. installs strop and vLLM (`make setup vllm`: CUDA torch and CUDA vLLM where nvidia-smi answers);
# 2. mid-trains a small MoE in HF format (Qwen3-MoE, 4 layers, 32 experts top-4, a tokenizer trained
#    on the stdlib) for MIDTRAIN_STEPS steps (default 50): the trainer on CUDA, bf16 autocast over
#    fp32 master weights (trainer.device = "cuda", trainer.precision = "bf16");
# 3. SFT on SFT_EPISODES oracle demonstrations for SFT_STEPS steps (defaults 32 and 20), same trainer;
# 4. async RL for RL_STEPS steps (default 5): the trainer on CUDA in bf16, one vLLM engine on the same
#    GPU (a share rollout.vllm_gpu_memory = 0.3 of its memory) that returns the experts it routed
#    through, which the trainer replays; every version synced into vLLM between requests;
# 5. `strop bench engine --backend vllm --quick`: vLLM's rollout tokens/s at batch 16, and the MoE
#    routing decisions that flip between vLLM and the trainer without and with replay;
# 6. prints the figures as JSON (`python -m strop.bench.gpu_check`): tokens/s, MFU and peak memory
#    of each trainer stage, rollout tokens/s, weight-sync seconds, routing flips; and writes them to
#    OUT_DIR/summary.json.
#
# Expected: "[gpu_check] ok" after the JSON, in well under 10 minutes on one H100 (most of it the
# install and vLLM's start). The per-step lines of RL are in OUT_DIR/rl/metrics.jsonl.
#
#   scripts/gpu_check.sh --dry-run [OUT_DIR]  # on CPU, no install: every step with a tiny MoE, the
#                                             # trainer on the CPU in bf16 autocast, strop's engine
#                                             # in place of vLLM, the bench skipped
#
# The dry run is what the fast test suite runs (tests/test_gpu_check.py), so every step but vLLM's
# own and CUDA's is exercised where no GPU is.
set -euo pipefail

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
OUT=$(realpath -m "${1:-runs/gpu_check}")  # relative to where it was started
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
STROP=("$PY" -m strop.cli)
say() { echo "[gpu_check] $*"; }

if [[ $DRY_RUN == 1 ]]; then
  say "dry run: CPU, a tiny MoE, strop's engine in place of vLLM, no install, no bench"
  MIDTRAIN_STEPS=${MIDTRAIN_STEPS:-2} SFT_EPISODES=${SFT_EPISODES:-4} SFT_STEPS=${SFT_STEPS:-2} RL_STEPS=${RL_STEPS:-1}
  LIB=$("$PY" -c 'import json, os; print(os.path.dirname(os.path.dirname(json.__file__)))')
  MACHINE=(--set trainer.device=cpu --set rollout.engine=strop
           --set model.hidden_size=32 --set model.num_layers=2 --set model.num_heads=2 --set model.num_kv_heads=1
           --set model.head_dim=16 --set model.num_experts=8 --set model.experts_per_token=2
           --set model.expert_size=16 --set model.dense_size=64
           --set data.stdlib=false --set "data.dirs=[\"$LIB/json\"]" --set data.val_files=2
           --set data.vocab_size=400 --set data.seq_len=64 --set data.tokenizer_sample_bytes=100000)
else
  command -v nvidia-smi >/dev/null || { echo "gpu_check: no nvidia-smi here (use --dry-run on CPU)" >&2; exit 2; }
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  make setup vllm
  MIDTRAIN_STEPS=${MIDTRAIN_STEPS:-50} SFT_EPISODES=${SFT_EPISODES:-32} SFT_STEPS=${SFT_STEPS:-20} RL_STEPS=${RL_STEPS:-5}
  MACHINE=(--set trainer.device=cuda --set rollout.engine=vllm --set rollout.vllm_gpu_memory=0.3
           --set data.vocab_size=1024 --set data.tokenizer_sample_bytes=2000000)
fi
mkdir -p "$OUT"
SETTINGS=(--set run.name=gpu_check --set "run.out_dir=$OUT" --set model.arch=qwen3_moe --set trainer.precision=bf16
          --set midtrain.steps="$MIDTRAIN_STEPS" --set midtrain.batch_size=4 --set midtrain.eval_every=1000
          --set midtrain.eval_batches=1
          --set sft.episodes="$SFT_EPISODES" --set sft.max_steps="$SFT_STEPS" --set sft.eval_every=2
          --set sft.batch_size=2 --set sft.demo_tests=false --set sft.demo_workers=2
          --set rl.steps="$RL_STEPS" --set rl.group_size=2 --set rl.batch_groups=2
          --set rl.skip_zero_advantage=false --set rl.weight_decay=0.1 --set rl.lr=1e-3
          --set rollout.workers=4 --set rollout.max_turns=2 --set rollout.max_turn_tokens=32
          --set rollout.max_context=1024 --set rollout.train_tasks=8 "${MACHINE[@]}")

say "mid-training a small MoE in HF format, $MIDTRAIN_STEPS steps"
"${STROP[@]}" midtrain "${SETTINGS[@]}" > "$OUT/midtrain.log"
say "SFT on $SFT_EPISODES demonstrations, $SFT_STEPS steps"
"${STROP[@]}" sft --policy "$OUT/gpu_check/midtrain/model" "${SETTINGS[@]}" > "$OUT/sft.log"
POLICY="$OUT/gpu_check/sft/model"
test -f "$POLICY/config.json"

say "async RL, $RL_STEPS steps"
"${STROP[@]}" train --mode async --policy "$POLICY" --out "$OUT/rl" "${SETTINGS[@]}"
steps=$(wc -l < "$OUT/rl/metrics.jsonl")
say "rl: $steps steps"
test "$steps" -ge "$RL_STEPS"

if [[ $DRY_RUN == 0 ]]; then
  say "bench: vLLM vs strop's engine, batch 16, routing flips with and without replay"
  "${STROP[@]}" bench engine --backend vllm --quick --checkpoint "$POLICY" --json "$OUT/bench.json"
fi
"$PY" -m strop.bench.gpu_check "$OUT"
say ok
