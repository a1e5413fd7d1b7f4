#!/usr/bin/env bash
# Runs the whole test suite: sets up the project environment if needed, then pytest.
#
#   ./scripts/test.sh [pytest args]      e.g. ./scripts/test.sh -k parity -x
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/setup_env.sh
py="${TORCHTITAN_VENV:-.venv}/bin/python"
# One thread per process: multi-process tests start several ranks on few cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$py" -m pytest "$@"
