"""Process-group internals: the default group's timeout and store, NCCL's flight recorder, and the
functional collectives (traceable by torch.compile, autograd-aware)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as _funcol

from torchtitan.runtime.torch_compat import CPU_AND_PRESENT_IN_2_11, PrivateName

_FUNCOL = "torch.distributed._functional_collectives"
PRIVATE_NAMES = (
    PrivateName("torch.distributed.distributed_c10d._set_pg_timeout", ("timeout", "group"), checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName("torch.distributed.distributed_c10d._get_default_store", ()),
    # On builds with NCCL (CUDA) only; the watchdog skips the dump without it.
    PrivateName("torch._C._distributed_c10d._dump_nccl_trace", optional=True, checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName(f"{_FUNCOL}.all_to_all_single", ("self", "output_split_sizes", "input_split_sizes", "group")),
    PrivateName(f"{_FUNCOL}.all_to_all_single_autograd", ("self", "output_split_sizes", "input_split_sizes", "group"),
                checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName(f"{_FUNCOL}.all_reduce", ("self", "reduceOp", "group")),
    PrivateName(f"{_FUNCOL}.wait_tensor", ("tensor",)),
    PrivateName(f"{_FUNCOL}.AsyncCollectiveTensor"),
)


def set_default_timeout(seconds: float) -> None:
    """Changes the collective timeout of the default process group after it exists; the public
    API sets it only when the group is created."""
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))


def default_store() -> dist.Store:
    """The key-value store the default process group was created on (its rendezvous), shared by
    every rank; the public API does not hand it out."""
    return dist.distributed_c10d._get_default_store()


def dump_nccl_trace() -> bytes | None:
    """NCCL's flight recorder (its last collectives, pickled), or None where the build has none."""
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    return None if dump is None else dump()


# Functional collectives return a tensor (waited on when first used, or by `wait`), can be traced
# by torch.compile, and the `_autograd` variant carries gradients back; the public c10d collectives
# do neither. torchtitan uses the same module for expert parallelism.
all_to_all_single = _funcol.all_to_all_single
all_to_all_single_autograd = _funcol.all_to_all_single_autograd
all_reduce = _funcol.all_reduce


def wait(tensor: torch.Tensor) -> torch.Tensor:
    """The result of a functional collective, waited for (a plain tensor is returned as it is)."""
    return _funcol.wait_tensor(tensor) if isinstance(tensor, _funcol.AsyncCollectiveTensor) else tensor
