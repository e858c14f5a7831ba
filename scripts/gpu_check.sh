#!/usr/bin/env bash
# The prepared GPU check of vLLM as strop's engine (issue 19). On a machine with an NVIDIA GPU:
#
#   scripts/gpu_check.sh [OUT_DIR]            # default OUT_DIR: runs/gpu_check
#
# 1. installs strop and vLLM (`make setup vllm`: CUDA vLLM where nvidia-smi answers);
# 2. builds a small MoE in HF format (Qwen3-MoE, 4 layers, 32 experts top-4, tokenizer trained
#    on the stdlib): `strop midtrain` for MIDTRAIN_STEPS steps (default 20);
# 3. runs async RL for RL_STEPS steps (default 3) with rollout.engine = "vllm": rollouts from
#    vLLM, each published version loaded into it between requests;
# 4. `strop bench engine --backend vllm --quick`: rollout tokens/s of vLLM and strop's engine at
#    batch 16, and routing flips / |dlogp| / k3 to the trainer with and without replay.
#
# Expected output, in well under 10 minutes on one GPU: the RL run's per-step lines ending in
# "[gpu_check] rl: N steps", then the bench's tables (vLLM tok/s far above strop's CPU engine;
# replay rows with flips 0), then "[gpu_check] ok" and OUT_DIR/{rl,bench.json,summary.txt}.
# The swap pause of every weight update is in OUT_DIR/rl/metrics.jsonl.
#
#   scripts/gpu_check.sh --dry-run [OUT_DIR]  # on CPU, no install: the same steps with strop's
#                                             # engine in place of vLLM and the bench skipped
#
# The dry run is what the test suite runs (tests/test_gpu_check.py), so every step but vLLM's own
# is exercised here; never a dependency of the suite otherwise.
set -euo pipefail

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
OUT=${1:-runs/gpu_check}
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
STROP=("$PY" -m strop.cli)
MIDTRAIN_STEPS=${MIDTRAIN_STEPS:-20}
RL_STEPS=${RL_STEPS:-3}
say() { echo "[gpu_check] $*"; }

if [[ $DRY_RUN == 1 ]]; then
  ENGINE=strop
  say "dry run: CPU, strop's engine in place of vLLM, no install, no bench"
else
  command -v nvidia-smi >/dev/null || { echo "gpu_check: no nvidia-smi here (use --dry-run on CPU)" >&2; exit 2; }
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  make setup vllm
  ENGINE=vllm
fi
mkdir -p "$OUT"
SETTINGS=(--set run.name=gpu_check --set "run.out_dir=$OUT" --set model.arch=qwen3_moe --set data.vocab_size=1024
          --set midtrain.steps="$MIDTRAIN_STEPS" --set midtrain.batch_size=4 --set midtrain.eval_every=1000
          --set midtrain.eval_batches=1 --set rl.steps="$RL_STEPS" --set rl.group_size=2 --set rl.batch_groups=2
          --set rl.skip_zero_advantage=false --set rl.weight_decay=0.1 --set rl.lr=1e-3
          --set rollout.engine=$ENGINE --set rollout.workers=4 --set rollout.max_turns=2
          --set rollout.max_turn_tokens=32 --set rollout.max_context=1024 --set rollout.train_tasks=8)

say "building a small MoE in HF format ($MIDTRAIN_STEPS mid-training steps)"
"${STROP[@]}" midtrain "${SETTINGS[@]}" > "$OUT/midtrain.json"
POLICY="$OUT/gpu_check/midtrain/model"
test -f "$POLICY/config.json"

say "async RL, $RL_STEPS steps, rollout.engine=$ENGINE"
start=$(date +%s)
"${STROP[@]}" train --mode async --policy "$POLICY" --out "$OUT/rl" "${SETTINGS[@]}"
steps=$(wc -l < "$OUT/rl/metrics.jsonl")
say "rl: $steps steps in $(( $(date +%s) - start )) s"
test "$steps" -ge "$RL_STEPS"

if [[ $DRY_RUN == 0 ]]; then
  say "bench: vLLM vs strop's engine, batch 16, mismatch with and without replay"
  "${STROP[@]}" bench engine --backend vllm --quick --checkpoint "$POLICY" --json "$OUT/bench.json"
fi
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
rows = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
lines = [f"rl steps: {len(rows)}"]
bench = out / "bench.json"
if bench.exists():
    b = json.loads(bench.read_text())
    lines += [f"{k}: {b[k]}" for k in ("vllm_tok_s_bs16", "engine_tok_s_bs16", "vllm_flips_without_replay",
                                        "vllm_replay_flips", "vllm_mean_abs_dlogp", "vllm_startup_s")]
(out / "summary.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
say ok
