#!/usr/bin/env bash
# SmolLM2-135M-Instruct learning in a real repository on this CPU (examples/smol.toml): tasks
# synthesized from tomli (REPO: a git repository or bundle; copied beside the task file, which
# names only what is in its own directory), the held-out evaluation before, an SFT warm start in
# its own template with tools, the evaluation after it, a short RL run from there and the
# evaluation after that. Every stage's wall time goes to runs/smol/stages.txt, the evaluations'
# figures to runs/smol/eval-*.json. Run from the repository root after `make smol`.
set -euo pipefail
REPO=${REPO:-/work/shared/repos/tomli.bundle}
TASKS=${TASKS:-61}  # single bugs kept: where this session's CPU budget cut synthesis
STROP=${STROP:-.venv/bin/strop}
mkdir -p runs/smol
stage() {
  local name=$1 t
  shift
  t=$(date +%s)
  "$@"
  echo "[learn] $name: $(($(date +%s) - t)) s" | tee -a runs/smol/stages.txt
}

POLICY=$($STROP model import)
SRC=runs/smol/$(basename "$REPO")
[ -e "$SRC" ] || cp -r "$REPO" "$SRC"
[ -s runs/smol/tomli.jsonl ] ||
  stage synth $STROP tasks synth --repo "$SRC" --out runs/smol/tomli.jsonl --max-tasks "$TASKS" --combined 0 --jobs 2
stage eval-base $STROP eval policy --config examples/smol.toml --policy "$POLICY" --json runs/smol/eval-base.json
stage sft $STROP sft --config examples/smol.toml --policy "$POLICY"
stage eval-sft $STROP eval policy --config examples/smol.toml --policy runs/smol/sft/model --json runs/smol/eval-sft.json
stage rl $STROP train --config examples/smol.toml --policy runs/smol/sft/model --force
stage eval-rl $STROP eval policy --config examples/smol.toml --policy runs/smol/rl/model --json runs/smol/eval-rl.json
