#!/usr/bin/env bash
# Runs a Python script of this checkout with the project's interpreter. Every scripts/*.py starts
# with a line that calls this, so that `scripts/<name>.py ...` works as the docs show it, whatever
# `python` is on PATH, and on a fresh machine too: the first call sets up .venv, as
# run_llama_train.sh does (scripts/setup_env.sh; later calls skip it in milliseconds).
#
#   scripts/project_python.sh scripts/<name>.py [args...]
#
# Env: TORCHTITAN_VENV, TORCHTITAN_PYTHON (scripts/setup_env.sh).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The set-up's lines go to stderr: a script's stdout (JSON, a table) stays its own.
"$here/setup_env.sh" >&2
exec "${TORCHTITAN_VENV:-$here/../.venv}/bin/python" "$@"
