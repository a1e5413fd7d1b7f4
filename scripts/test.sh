#!/usr/bin/env bash
# Runs the test suite: sets up the project environment if needed, then pytest.
#
#   ./scripts/test.sh                    every test (what CI runs), measured by coverage.py, then
#                                        the error-path report: which raise / except / exit paths
#                                        ran, and a failure for one that did not and has no reason
#                                        in tests/error_paths_uncovered.txt (docs/testing.md)
#   ./scripts/test.sh --fast             the fast tier: unit tests and the cheapest multi-process
#                                        test of each feature (the inner loop; docs/testing.md)
#   ./scripts/test.sh [--fast] [pytest args]   e.g. ./scripts/test.sh -k parity -x
#
# Env: TORCHTITAN_COVERAGE=0 runs the whole suite without coverage (and without the report).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/setup_env.sh
py="${TORCHTITAN_VENV:-.venv}/bin/python"
args=()
whole=1  # no selection: every test runs, so the error-path report is complete
for arg in "$@"; do
  case "$arg" in
    --fast) args+=(-m fast); whole=0 ;;
    -q|-v|-vv|-s|--quiet|--verbose) args+=("$arg") ;;
    *) args+=("$arg"); whole=0 ;;
  esac
done
# One thread per process: multi-process tests start several ranks on few cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [[ "$whole" == 0 || "${TORCHTITAN_COVERAGE:-1}" == 0 ]]; then
  exec "$py" -m pytest ${args[@]+"${args[@]}"}
fi
# Every process the tests start is measured too (pyproject.toml [tool.coverage.run]); each writes
# its own data file here, combined once the suite ends.
data="$PWD/.coverage-data"
rm -rf "$data" && mkdir -p "$data"
rc=0
"$py" -m coverage run --data-file="$data/suite" -m pytest ${args[@]+"${args[@]}"} || rc=$?
if (( rc != 0 )); then
  # Failed or interrupted tests leave paths unrun that the suite does run: the report would mislead.
  echo "error-path report skipped: the suite did not pass" >&2
  exit $rc
fi
"$py" -m coverage combine --quiet --data-file="$data/suite" "$data"
exec "$py" -m tests.error_paths --data-file "$data/suite" --check
