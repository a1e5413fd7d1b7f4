"""Functional collectives: they return a tensor (waited on when first used, or by `wait`), can be
traced by torch.compile, and the `_autograd` variant carries gradients back; the public c10d
collectives do neither. They live only in a private module in torch 2.11-2.13 (torchtitan's
expert parallelism uses the same)."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as _funcol

from torchtitan.runtime.torch_compat import CPU_AND_PRESENT_IN_2_11, PrivateName

_FUNCOL = "torch.distributed._functional_collectives"
_SPLITS = ("self", "output_split_sizes", "input_split_sizes", "group")
PRIVATE_NAMES = (
    PrivateName(f"{_FUNCOL}.all_to_all_single", _SPLITS),
    PrivateName(f"{_FUNCOL}.all_to_all_single_autograd", _SPLITS, checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName(f"{_FUNCOL}.all_reduce", ("self", "reduceOp", "group")),
    PrivateName(f"{_FUNCOL}.wait_tensor", ("tensor",)),
    PrivateName(f"{_FUNCOL}.AsyncCollectiveTensor"),
)

all_to_all_single = _funcol.all_to_all_single
all_to_all_single_autograd = _funcol.all_to_all_single_autograd
all_reduce = _funcol.all_reduce


def wait(tensor: torch.Tensor) -> torch.Tensor:
    """The result of a functional collective, waited for (a plain tensor is returned as it is)."""
    return _funcol.wait_tensor(tensor) if isinstance(tensor, _funcol.AsyncCollectiveTensor) else tensor
