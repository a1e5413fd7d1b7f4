#!/usr/bin/env bash
# The calls to make first on a lent GPU (docs/gpu_check.md, top): each fits one call of the device
# tool (10 minutes, run with carry ".whl"), writes its JSON reports into $OUT and prints tables.
#
#   scripts/setup_anchor.sh --gpu-wheels   # before, on a machine with a package registry: .whl/ (4 MB)
#   scripts/gpu_wave.sh 1    # this stack against torchtitan (1B, 3B at 8192, compiled); 8B, 3B 2x8192, float8 rowwise, profile
#   scripts/gpu_wave.sh 2    # every CUDA path not yet run; the 8B side by side
#   scripts/gpu_wave.sh 3    # the earlier GPU check (scripts/gpu_check.sh), for a third call
#
# Env: PYTHON (default python3: the GPU image's, which holds PyTorch), OUT (default ./gpu_wave_out),
# GPU_WAVE_SECONDS (the call's time, default 560: a run stopped at its timeout may take a minute more).
set -uo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
py="${PYTHON:-python3}"
out="${OUT:-$repo_root/gpu_wave_out}"
budget="${GPU_WAVE_SECONDS:-560}"
started=$(date +%s)
left() { echo $(( budget - ($(date +%s) - started) - ${1:-0} )); }
mkdir -p "$out"

# The carried wheels: the project's extra imports on PYTHONPATH; the anchor in its own folder, which
# only the side-by-side worker puts on its path (both import as `torchtitan`).
if [[ -d .whl ]]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  [[ -d .whl/anchor ]] && "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/anchor-site .whl/anchor/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
status=0
side_by_side() {  # name, budget, worker options
  local name="$1" seconds="$2"; shift 2
  "$py" scripts/side_by_side.py --anchor-python "$py" --anchor-site /tmp/anchor-site --budget-seconds "$seconds" \
    --compile --out "$out/side_by_side_$name.json" "$@" || status=1
}
case "${1:-}" in
  1)
    side_by_side 1b_3b "$(left 260)" --shapes 1B 3B --seq 8192 --batch 1 --steps 8 --warmup 4 --rounds 1 \
      --ac selective --timeout 150
    "$py" scripts/gpu_paths.py --part scale --budget-seconds "$(left)" --out "$out/gpu_paths_scale.json" || status=1
    ;;
  2)
    "$py" scripts/gpu_paths.py --part paths --budget-seconds "$(left 200)" --out "$out/gpu_paths_paths.json" || status=1
    side_by_side 8b "$(left)" --shapes 8B --seq 4096 --batch 1 --steps 6 --warmup 3 --rounds 1 --ac full --timeout 200
    ;;
  3)
    PYTHON="$py" scripts/gpu_check.sh --budget-seconds "$(left)" --out "$out/gpu_check.json" || status=1
    ;;
  *)
    echo "usage: scripts/gpu_wave.sh 1|2|3" >&2
    exit 2
    ;;
esac
echo "gpu_wave $1: reports in $out ($(( $(date +%s) - started )) s)"
exit $status
