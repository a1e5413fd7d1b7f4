#!/usr/bin/env bash
# Runs the test suite: sets up the project environment if needed, then pytest.
#
#   ./scripts/test.sh                    every test (what CI runs)
#   ./scripts/test.sh --fast             the fast tier: unit tests and the cheapest multi-process
#                                        test of each feature (the inner loop; docs/testing.md)
#   ./scripts/test.sh [--fast] [pytest args]   e.g. ./scripts/test.sh -k parity -x
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/setup_env.sh
py="${TORCHTITAN_VENV:-.venv}/bin/python"
args=()
for arg in "$@"; do
  if [[ "$arg" == "--fast" ]]; then args+=(-m fast); else args+=("$arg"); fi
done
# One thread per process: multi-process tests start several ranks on few cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$py" -m pytest ${args[@]+"${args[@]}"}
