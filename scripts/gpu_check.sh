#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py, docs/gpu_check.md) with the project's Python: $PYTHON if set,
# else the project venv ($TORCHTITAN_VENV or .venv) where it imports torch, else python3.
#
#   scripts/gpu_check.sh [--out report.json] [--seq-len 4096] [--dry]
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
  venv_py="${TORCHTITAN_VENV:-$repo_root/.venv}/bin/python"
  if [[ -x "$venv_py" ]] && "$venv_py" -c 'import torch' 2>/dev/null; then py="$venv_py"; else py=python3; fi
fi
exec "$py" "$repo_root/scripts/gpu_check.py" "$@"
