"""Process-group internals: the default group's timeout and store, NCCL's flight recorder. Light to
import: the watchdog's thread imports it while the main thread may be stuck."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from torchtitan.runtime.torch_compat import CPU_AND_PRESENT_IN_2_11, PrivateName

PRIVATE_NAMES = (
    PrivateName("torch.distributed.distributed_c10d._set_pg_timeout", ("timeout", "group"),
                checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName("torch.distributed.distributed_c10d._get_default_store", ()),
    # On builds with NCCL (CUDA) only; the watchdog skips the dump without it.
    PrivateName("torch._C._distributed_c10d._dump_nccl_trace", optional=True, checked=CPU_AND_PRESENT_IN_2_11),
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
