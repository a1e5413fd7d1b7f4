#!/usr/bin/env bash
# Launches training on this machine with torchrun.
#
#   ./run_llama_train.sh [--section.key value ...]     extra arguments override the config
#
# Env:
#   NGPU         processes to start (default: number of visible GPUs, else 2 CPU processes)
#   CONFIG_FILE  TOML config (default: train_configs/debug_model.toml)
#   LOG_RANK     ranks whose output is shown, comma-separated (default: 0)
#
# Exit codes: 0 done, 1 bug, 2 user error, 3 non-finite loss, 4 checkpoint save failed,
# 130 stopped by Ctrl-C, 143 stopped by SIGTERM (README "Exit codes").
#   OMP_NUM_THREADS  CPU threads per process (default: cores / NGPU, at least 1)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

./scripts/setup_env.sh
py=".venv/bin/python"
if [[ -n "${TORCHTITAN_VENV:-}" ]]; then py="$TORCHTITAN_VENV/bin/python"; fi

CONFIG_FILE="${CONFIG_FILE:-train_configs/debug_model.toml}"
LOG_RANK="${LOG_RANK:-0}"
fail() { echo "error: $*" >&2; exit 2; }
if [[ -z "${NGPU:-}" ]]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  NGPU=$(( gpus > 0 ? gpus : 2 ))
fi
# The variables are checked before any arithmetic: bash would read NGPU=abc as a variable name.
[[ "$NGPU" =~ ^[1-9][0-9]*$ ]] || fail "NGPU must be a positive number of processes, got '$NGPU'"
[[ "$LOG_RANK" =~ ^[0-9]+(,[0-9]+)*$ ]] || fail "LOG_RANK must be a rank or comma-separated ranks (e.g. 0 or 0,3), got '$LOG_RANK'"
for r in ${LOG_RANK//,/ }; do
  (( 10#$r < NGPU )) || fail "LOG_RANK $r is not a rank of this job (NGPU=$NGPU: ranks 0..$(( NGPU - 1 )))"
done
if [[ -n "${OMP_NUM_THREADS:-}" ]]; then
  [[ "$OMP_NUM_THREADS" =~ ^[1-9][0-9]*$ ]] || fail "OMP_NUM_THREADS must be a positive number, got '$OMP_NUM_THREADS'"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}"

# Check the config once, before any process starts: a bad option gets one line and exit code 2.
WORLD_SIZE="$NGPU" "$py" -m torchtitan.config_manager --job.config_file "$CONFIG_FILE" "$@"
for arg in "$@"; do
  if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then exit 0; fi
done

# torchtitan.launch is torchrun that ends with one line: the root cause, from whichever rank.
exec "$py" -m torchtitan.launch --standalone --nproc_per_node="$NGPU" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m torchtitan.train --job.config_file "$CONFIG_FILE" "$@"
