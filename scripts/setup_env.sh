#!/usr/bin/env bash
# Creates or reuses the project virtual environment and installs the project into it.
#
# Usage: scripts/setup_env.sh            (prints nothing when already set up)
# Both README commands call this first, so each works alone on a fresh machine.
#
# Env:
#   TORCHTITAN_VENV   where the environment lives (default: .venv in the repo root)
#   TORCHTITAN_PYTHON interpreter used to create it (default: python3.11, else python3)
#
# Torch policy: a torch >= 2.11 that the base interpreter can already import (e.g. the CUDA
# build preinstalled on a GPU host) is reused through --system-site-packages, never replaced.
# Otherwise torch==2.13.0 is installed first; on a CPU-only machine that exact pin resolves to
# the CPU wheel, while an unpinned torch would pull several GB of CUDA packages.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TORCHTITAN_VENV:-$repo_root/.venv}"
stamp="$venv/.torchtitan-installed"
torch_pin="torch==2.13.0"

# The stamp records what was installed; a changed pyproject.toml triggers a re-install.
want="$(cat "$repo_root/pyproject.toml" "$0" | sha256sum | cut -d' ' -f1)"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

base_py="${TORCHTITAN_PYTHON:-}"
if [[ -z "$base_py" ]]; then
  if command -v python3.11 >/dev/null 2>&1; then base_py=python3.11; else base_py=python3; fi
fi
if ! "$base_py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
  echo "setup_env: Python >= 3.10 is required; '$base_py' is $("$base_py" --version 2>&1). Set TORCHTITAN_PYTHON." >&2
  exit 1
fi

venv_flags=()
if "$base_py" - <<'PY' 2>/dev/null
import sys
import torch
major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PY
then
  echo "setup_env: reusing the torch preinstalled for $base_py"
  venv_flags+=(--system-site-packages)
fi

echo "setup_env: preparing $venv (one-time; later calls skip this)"
if [[ ! -x "$venv/bin/python" ]]; then
  "$base_py" -m venv "${venv_flags[@]}" "$venv"
fi
py="$venv/bin/python"
pip_flags=(--quiet --disable-pip-version-check)
# Hosts whose pip config names index folders that do not exist make pip warn once per package.
quiet_pip() { "$py" -m pip install "${pip_flags[@]}" "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }; }
if ! "$py" -c 'import torch' 2>/dev/null; then
  echo "setup_env: installing $torch_pin"
  quiet_pip "$torch_pin"
fi
echo "setup_env: installing the project and its test extras"
quiet_pip -e "$repo_root[test]"
echo "$want" >"$stamp"
echo "setup_env: ready ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
