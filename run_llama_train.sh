#!/usr/bin/env bash
# Launches training with torchrun: on this machine, or on one node of several (docs/operations.md).
#
#   ./run_llama_train.sh [--section.key value ...]     extra arguments override the config
#
# Env:
#   NGPU          processes to start on this node (default: number of visible GPUs, else 2 CPU processes)
#   CONFIG_FILE   TOML config (default: train_configs/debug_model.toml)
#   LOG_RANK      local ranks whose output is shown on this node, comma-separated (default: 0)
#   OMP_NUM_THREADS  CPU threads per process (default: cores / NGPU, at least 1)
#   NNODES        nodes in the job (default 1); above 1 every node runs this script, and the nodes
#                 meet at RDZV_ENDPOINT (torchrun's c10d rendezvous) instead of --standalone
#   NODE_RANK     this node's index, 0..NNODES-1; node 0 hosts the rendezvous at RDZV_ENDPOINT
#   RDZV_ENDPOINT host:port of node 0 that every node can reach (required when NNODES > 1)
#   RDZV_ID       the job's name at the rendezvous, the same on every node (default: torchtitan)
#   LOCAL_ADDR    this node's address as the others reach it (default: its host name resolved)
#   RDZV_TIMEOUT  seconds a node waits at the rendezvous for all NNODES nodes before it ends with
#                 exit code 2, naming the nodes that never arrived (default 600, torchrun's own)
#   RDZV_PROGRESS_INTERVAL  seconds between the lines a waiting node prints, saying how long it has
#                 waited and which NODE_RANKs are missing (default 30)
#   MAX_RESTARTS  times torchrun restarts every rank after a failure (default 0); each restart
#                 resumes from the newest complete checkpoint (checkpoint.enable_checkpoint)
#   FT_LIGHTHOUSE fault_tolerance's replica groups (docs/fault_tolerance.md): "start" starts a torchft
#                 lighthouse on this host before the ranks and stops it when this script ends;
#                 host:port joins the lighthouse there. Either way the ranks read it from TORCHFT_LIGHTHOUSE.
#   FT_LIGHTHOUSE_PORT  the port a started lighthouse binds (default 29510)
#   FT_MIN_REPLICAS  the fewest replica groups a started lighthouse forms a quorum with (default 1)
#   FT_LIGHTHOUSE_ARGS  further torchft_lighthouse options of a started lighthouse (default:
#                 --join_timeout_ms 10000, how long a quorum waits for a group that is still starting)
#
# Exit codes: 0 done, 1 bug, 2 user error, 3 non-finite loss, 4 checkpoint save failed, 5 a rank
# hung, 75 preempted with a checkpoint (launch again to resume), 130 stopped by Ctrl-C, 138/143
# stopped by SIGUSR1/SIGTERM without a checkpoint (README "Exit codes").
fail() { local line="error: $*"; echo "${line//$'\n'/\\n}" >&2; exit 2; }  # one line, whatever the value holds
# A whole number bash can compute with: at most 9 digits, since its arithmetic wraps silently past
# 2**63 (NODE_RANK 9223372036854775808 would pass a "< NNODES" test as a negative number).
is_count() { [[ "$1" =~ ^[0-9]{1,9}$ ]]; }
is_port() { [[ "$1" =~ ^[0-9]{1,5}$ ]] && (( 10#$1 > 0 && 10#$1 < 65536 )); }

# The launcher's variables: defaults filled in, each checked before any arithmetic (bash would read
# NGPU=abc as a variable name) and before any process starts; a mistake is one line, exit code 2.
# A function, so that a test can drive it alone: sourcing this script defines it and returns.
check_launcher_variables() {
  LOG_RANK="${LOG_RANK:-0}"
  if [[ -z "${NGPU:-}" ]]; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    NGPU=$(( gpus > 0 ? gpus : 2 ))
  fi
  is_count "$NGPU" && (( 10#$NGPU > 0 )) || fail "NGPU must be a positive number of processes, got '$NGPU'"
  [[ "$LOG_RANK" =~ ^[0-9]{1,9}(,[0-9]{1,9})*$ ]] || fail "LOG_RANK must be a rank or comma-separated ranks (e.g. 0 or 0,3), got '$LOG_RANK'"
  for r in ${LOG_RANK//,/ }; do
    (( 10#$r < 10#$NGPU )) || fail "LOG_RANK $r is not a rank of this job (NGPU=$NGPU: ranks 0..$(( 10#$NGPU - 1 )))"
  done
  NNODES="${NNODES:-1}"
  NODE_RANK="${NODE_RANK:-0}"
  MAX_RESTARTS="${MAX_RESTARTS:-0}"
  RDZV_TIMEOUT="${RDZV_TIMEOUT:-600}"
  is_count "$NNODES" && (( 10#$NNODES > 0 )) || fail "NNODES must be a positive number of nodes, got '$NNODES'"
  is_count "$NODE_RANK" && (( 10#$NODE_RANK < 10#$NNODES )) \
    || fail "NODE_RANK must be this node's index, 0..$(( 10#$NNODES - 1 )) (NNODES=$NNODES), got '$NODE_RANK'"
  is_count "$MAX_RESTARTS" || fail "MAX_RESTARTS must be a number of restarts (0 or more), got '$MAX_RESTARTS'"
  is_count "$RDZV_TIMEOUT" && (( 10#$RDZV_TIMEOUT > 0 )) \
    || fail "RDZV_TIMEOUT must be the seconds the nodes wait for each other at the rendezvous (1 or more), got '$RDZV_TIMEOUT'"
  if [[ -n "${RDZV_PROGRESS_INTERVAL:-}" ]]; then
    is_count "$RDZV_PROGRESS_INTERVAL" && (( 10#$RDZV_PROGRESS_INTERVAL > 0 )) \
      || fail "RDZV_PROGRESS_INTERVAL must be the seconds between a waiting node's progress lines (1 or more), got '$RDZV_PROGRESS_INTERVAL'"
  fi
  if (( 10#$NNODES > 1 )); then
    [[ "${RDZV_ENDPOINT:-}" =~ ^[^:[:space:]]+:([0-9]+)$ ]] && is_port "${BASH_REMATCH[1]}" \
      || fail "NNODES=$NNODES needs RDZV_ENDPOINT=host:port, node 0's address and a free port every node can reach, got '${RDZV_ENDPOINT:-}'"
  fi
  if [[ -n "${OMP_NUM_THREADS:-}" ]]; then
    is_count "$OMP_NUM_THREADS" && (( 10#$OMP_NUM_THREADS > 0 )) || fail "OMP_NUM_THREADS must be a positive number, got '$OMP_NUM_THREADS'"
  fi
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / 10#$NGPU > 0 ? $(nproc) / 10#$NGPU : 1 ))}"
  if [[ -n "${FT_LIGHTHOUSE:-}" && "$FT_LIGHTHOUSE" != "start" ]]; then
    [[ "$FT_LIGHTHOUSE" =~ ^[^:[:space:]]+:([0-9]+)$ ]] && is_port "${BASH_REMATCH[1]}" \
      || fail "FT_LIGHTHOUSE must be 'start' or the host:port of a running torchft lighthouse, got '$FT_LIGHTHOUSE'"
  elif [[ -n "${FT_LIGHTHOUSE:-}" ]]; then
    FT_LIGHTHOUSE_PORT="${FT_LIGHTHOUSE_PORT:-29510}"
    FT_MIN_REPLICAS="${FT_MIN_REPLICAS:-1}"
    is_port "$FT_LIGHTHOUSE_PORT" \
      || fail "FT_LIGHTHOUSE_PORT must be a port number for the lighthouse, got '$FT_LIGHTHOUSE_PORT'"
    is_count "$FT_MIN_REPLICAS" && (( 10#$FT_MIN_REPLICAS > 0 )) \
      || fail "FT_MIN_REPLICAS must be the fewest replica groups of a quorum (1 or more), got '$FT_MIN_REPLICAS'"
    FT_LIGHTHOUSE_PORT=$(( 10#$FT_LIGHTHOUSE_PORT )) FT_MIN_REPLICAS=$(( 10#$FT_MIN_REPLICAS ))
  fi
  # Checked: now plain decimal numbers (08 would be octal, an error, to bash's arithmetic below).
  NGPU=$(( 10#$NGPU )) NNODES=$(( 10#$NNODES )) NODE_RANK=$(( 10#$NODE_RANK )) MAX_RESTARTS=$(( 10#$MAX_RESTARTS ))
  RDZV_TIMEOUT=$(( 10#$RDZV_TIMEOUT )) OMP_NUM_THREADS=$(( 10#$OMP_NUM_THREADS ))
}

[[ "${BASH_SOURCE[0]}" == "$0" ]] || return 0  # sourced: the definitions only

set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

./scripts/setup_env.sh
py=".venv/bin/python"
if [[ -n "${TORCHTITAN_VENV:-}" ]]; then py="$TORCHTITAN_VENV/bin/python"; fi

CONFIG_FILE="${CONFIG_FILE:-train_configs/debug_model.toml}"
check_launcher_variables
if (( NNODES > 1 )); then
  # c10d rendezvous: node 0 hosts the store at the endpoint (said outright, because a host name
  # that does not resolve to an address of this node would make every node a client). join_timeout
  # bounds the wait for the other nodes, the first time and after a restart.
  nodes=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-torchtitan}"
         --rdzv-conf="is_host=$(( 10#$NODE_RANK == 0 ? 1 : 0 )),join_timeout=$(( 10#$RDZV_TIMEOUT ))")
  # torchtitan.runtime.launch announces this node at the rendezvous by its NODE_RANK, so that the nodes
  # waiting there can name the ones that have not come.
  export NODE_RANK=$(( 10#$NODE_RANK ))
  if [[ -n "${LOCAL_ADDR:-}" ]]; then nodes+=(--local-addr="$LOCAL_ADDR"); fi
else
  nodes=(--standalone)
fi
if [[ -n "${FT_LIGHTHOUSE:-}" ]]; then
  "$py" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torchft") is None)' \
    || fail "FT_LIGHTHOUSE needs torchft, an optional extra: pip install 'torchtitan[ft]' (or pip install torchft)"
  if [[ "$FT_LIGHTHOUSE" != "start" ]]; then
    export TORCHFT_LIGHTHOUSE="$FT_LIGHTHOUSE"
  else
    lighthouse_bin="$(dirname "$py")/torchft_lighthouse"
    [[ -x "$lighthouse_bin" ]] || fail "FT_LIGHTHOUSE=start: no torchft_lighthouse beside $py (reinstall torchft)"
    export TORCHFT_LIGHTHOUSE="localhost:$FT_LIGHTHOUSE_PORT"  # started after the config check, below
  fi
fi

# Check the config once, before any process starts: a bad option gets one line and exit code 2.
for arg in "$@"; do
  if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then exec "$py" -m torchtitan.config.manager --help; fi
done
mode=$(WORLD_SIZE="$(( NGPU * NNODES ))" "$py" -m torchtitan.config.manager --launch-mode --job.config_file "$CONFIG_FILE" "$@")

if [[ "$mode" == "dry_run" ]]; then
  # job.dry_run: one process stands for every rank of the job (docs/memory.md); no torchrun.
  exec env TORCHTITAN_DRY_RUN_WORLD_SIZE="$(( NGPU * NNODES ))" TORCHTITAN_DRY_RUN_LOCAL_WORLD_SIZE="$NGPU" "$py" -m torchtitan.train \
    --job.config_file "$CONFIG_FILE" "$@"
fi

# torchtitan.runtime.launch is torchrun that ends with one line: the root cause, from whichever rank.
launch=("$py" -m torchtitan.runtime.launch "${nodes[@]}" --nproc_per_node="$NGPU" --max-restarts="$MAX_RESTARTS"
        --local-ranks-filter "$LOG_RANK" --role rank --tee 3
        -m torchtitan.train --job.config_file "$CONFIG_FILE" "$@")
if [[ "${FT_LIGHTHOUSE:-}" != "start" ]]; then exec "${launch[@]}"; fi

# FT_LIGHTHOUSE=start: the lighthouse outlives this group's ranks (MAX_RESTARTS restarts included) and
# ends with this script. Its log goes to a file; its last line is shown if it does not come up.
# Something already listening there (another group's lighthouse?) would pass for this one.
if (exec 3<>"/dev/tcp/127.0.0.1/$FT_LIGHTHOUSE_PORT") 2>/dev/null; then
  fail "FT_LIGHTHOUSE=start: port $FT_LIGHTHOUSE_PORT is taken; choose another FT_LIGHTHOUSE_PORT, or join the lighthouse there with FT_LIGHTHOUSE=$(hostname):$FT_LIGHTHOUSE_PORT"
fi
lighthouse_log=$(mktemp "${TMPDIR:-/tmp}/torchft_lighthouse.XXXXXX")
# shellcheck disable=SC2086  # FT_LIGHTHOUSE_ARGS is a list of options
RUST_LOG="${RUST_LOG:-warn}" "$lighthouse_bin" --min_replicas "$FT_MIN_REPLICAS" --bind "[::]:$FT_LIGHTHOUSE_PORT" \
  ${FT_LIGHTHOUSE_ARGS:---join_timeout_ms 10000} >"$lighthouse_log" 2>&1 &
lighthouse_pid=$!
stop_lighthouse() { kill "$lighthouse_pid" 2>/dev/null || true; wait "$lighthouse_pid" 2>/dev/null || true; rm -f "$lighthouse_log"; }
trap stop_lighthouse EXIT
for _ in $(seq 300); do  # up to 30 s: it imports torch first, which takes seconds on a loaded host
  if ! kill -0 "$lighthouse_pid" 2>/dev/null; then
    fail "FT_LIGHTHOUSE=start: the torchft lighthouse did not start on port $FT_LIGHTHOUSE_PORT: $(tail -n 1 "$lighthouse_log") (another FT_LIGHTHOUSE_PORT, or join the running one with FT_LIGHTHOUSE=host:port)"
  fi
  if (exec 3<>"/dev/tcp/127.0.0.1/$FT_LIGHTHOUSE_PORT") 2>/dev/null; then break; fi
  sleep 0.1
done
echo "run_llama_train.sh: torchft lighthouse on $(hostname):$FT_LIGHTHOUSE_PORT (min_replicas $FT_MIN_REPLICAS); the other groups join with FT_LIGHTHOUSE=$(hostname):$FT_LIGHTHOUSE_PORT" >&2
# torchrun runs as a child, so the trap can stop the lighthouse after it: the signals a launcher passes
# to its ranks are passed on to it (Ctrl-C reaches it from the terminal directly, like the ranks).
"${launch[@]}" &
launcher_pid=$!
for signal in TERM HUP USR1; do trap 'kill -'"$signal"' "$launcher_pid" 2>/dev/null || true' "$signal"; done
trap ':' INT
while kill -0 "$launcher_pid" 2>/dev/null; do wait "$launcher_pid" || true; done
rc=0
wait "$launcher_pid" || rc=$?
exit "$rc"
