"""The one seam between the product and PyTorch's private names.

PyTorch promises nothing about names that start with an underscore: each upgrade may rename,
move or change one, silently or loudly. Every private torch name the product needs lives in a
module of this package, by area (mesh, pipelining, composable data parallelism and checkpoint
wrappers, process groups, functional collectives, DCP, compile settings, ops and op names, CUDA
memory snapshots and memory trackers, fake tensors for the dry run, LR schedulers), behind a
small named function or constant whose docstring says why no public API serves. Each module lists the names it relies on in
`PRIVATE_NAMES`, with the torch versions they were checked against;
tests/unit_tests/test_torch_compat.py checks at import time that every one still exists with the
parameters it is called with, and that the product outside this package uses none
(tests/private_torch_names.py finds them).

Where a public API serves in torch 2.11-2.13, the product uses it directly instead: gradient
clipping scales with torch.nn.utils.clip_grads_with_norm_ (not torch._foreach_mul_), MoE experts
multiply with torch.nn.functional.grouped_mm (not torch._grouped_mm).
"""

from __future__ import annotations

from dataclasses import dataclass

# What "checked" means below: the unit and integration tests passed on this torch.
CPU = "2.13 (CPU)"
# ... and on the GPU machine's torch 2.11.0+cu130 the name exists with the same leading parameters
# (a one-off check on 2026-11-27; no test ran it there).
CPU_AND_PRESENT_IN_2_11 = "2.13 (CPU), 2.11 (present, same parameters)"
# ... and scripts/gpu_check.sh (one H100, torch 2.11.0+cu130) ran the code path that uses it
# (docs/gpu_reports/2026-11-27-*.json): single-GPU training with compile, the ring-attention
# kernels, CUDA memory snapshots, the dry run's memory estimate.
CPU_AND_GPU_CHECK = "2.13 (CPU), 2.11 (the GPU check's paths)"


@dataclass(frozen=True)
class PrivateName:
    """A private torch name the seam relies on.

    `path`: importable module path, then attributes (`torch.distributed.device_mesh.DeviceMesh._flatten`).
    `params`: for a callable, the parameter names it is called with, in order (a prefix of its
    signature's); None where it is not called or has no Python signature (C++ ops).
    `instance`: the last part is an attribute the owner class sets on its instances (checked in
    the class's source, since the class itself does not hold it).
    `optional`: the seam works without it (it checks first); absent from some builds.
    `checked`: the torch versions it was checked against.
    """

    path: str
    params: tuple[str, ...] | None = None
    instance: bool = False
    optional: bool = False
    checked: str = CPU
