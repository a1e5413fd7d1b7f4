#!/usr/bin/env bash
# The anchor of scripts/side_by_side.py: torchtitan from the package index, kept apart from this
# project (both import as `torchtitan`).
#
#   scripts/setup_anchor.sh               # .venv-anchor: torchtitan 0.3.0 on this machine's torch pin (CPU)
#   scripts/setup_anchor.sh --gpu-wheels  # .whl/: wheels for a GPU machine without a registry (docs/gpu_check.md)
#
# Only what its Llama 3 model path imports is installed (--no-deps; the list below was found by
# importing torchtitan.models.llama3, its parallelize and ParallelDims until nothing was missing):
# its trainer's data, checkpoint, metrics and logging stacks (datasets, wandb, torch_checkpointing,
# safetensors, einops, pillow, tensorboard) are never imported by that path and are left out.
#   0.3.0: spmd_types 0.2.3 (its pin), tyro, docstring_parser, typeguard, and triton (imported at
#          module level by its MoE dispatch; CUDA builds of torch ship it, the CPU build does not);
#          torchao for `--float8 rowwise` (as in this project's own environment).
#   0.2.2: torchdata, tyro, docstring_parser, typeguard, and datasets (its llama3 package imports
#          its data loader) with dill and multiprocess, in the versions that accept the GPU image's
#          huggingface_hub 1.x; tokenizers, tensorboard (with numpy, protobuf and absl), pyarrow,
#          pandas, httpx and fsspec are imported too, and are in the GPU image (docs/gpu_check.md).
# torchtitan 0.3.0 needs a PyTorch newer than 2.11 (torch.distributed.fsdp.DataParallelMeshDims);
# on a GPU machine with 2.11 the anchor is 0.2.2, the newest release that imports there.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
torch_pin="$(sed -n 's/^torch_pin="\(.*\)"$/\1/p' "$repo_root/scripts/setup_env.sh")"

if [[ "${1:-}" == "--gpu-wheels" ]]; then
  # .whl/: what this project imports beyond the GPU image (torchdata; torchao for float8), installed
  # there into /tmp/site; .whl/anchor/: the anchor and what its model path needs beyond the image,
  # installed into /tmp/anchor-site, apart, so that no `torchtitan` but ours is on the trainer's path.
  dest="$repo_root/.whl"
  mkdir -p "$dest/anchor"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$dest" torchdata==0.11.0
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$dest" torchao==0.18.0
  # Python 3.12, the GPU image's (multiprocess ships one wheel a Python version).
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$dest/anchor" torchtitan==0.2.2 \
    tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 datasets==4.4.1 dill==0.4.0 multiprocess==0.70.18
  du -sh "$dest"
  exit 0
fi

venv="${ANCHOR_VENV:-$repo_root/.venv-anchor}"
if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -I -c 'import torchtitan.models.llama3, torchao' 2>/dev/null; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q "$torch_pin"
"$venv/bin/python" -m pip install -q --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 \
  docstring_parser==0.18.0 typeguard triton torchao==0.18.0
"$venv/bin/python" -I -c 'import torchtitan.models.llama3, torchtitan.models.llama3.parallelize' \
  || { echo "setup_anchor: torchtitan 0.3.0 does not import in $venv" >&2; exit 1; }
echo "setup_anchor: $venv holds torchtitan 0.3.0"
