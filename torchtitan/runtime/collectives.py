"""The few collectives the trainer itself issues: host-side agreements between ranks and scalar
sums and means over a mesh (the model's own communication is DTensor's and FSDP's)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def max_across_ranks(values: list[float]) -> list[float]:
    """Element-wise maximum of a few host-side numbers over all ranks (a no-op on one process).
    The tensor stays on the CPU, so on GPUs it travels over gloo without waiting for the device."""
    if not dist.is_initialized():
        return [float(v) for v in values]
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def slowest_and_median(seconds: float) -> tuple[int, float, float] | None:
    """(slowest rank, its seconds, the median over ranks) of a per-rank time; None on one process.
    Host-side, over gloo, like max_across_ranks."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    times = [torch.zeros((), dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(times, torch.tensor(seconds, dtype=torch.float64))
    values = [t.item() for t in times]
    slowest = max(range(len(values)), key=values.__getitem__)
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return slowest, values[slowest], median


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any rank (a no-op on a single process)."""
    return bool(max_across_ranks([flag])[0])


def sum_across(value: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Sum of a scalar over a mesh; the value itself on a single process."""
    if mesh is None:
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return value


def mean_across(value: torch.Tensor, mesh: DeviceMesh | None) -> float:
    """Mean of a scalar over a mesh (for logging); the value itself on a single process."""
    if mesh is None:
        return value.item()
    value = value.detach().to(torch.float64, copy=True)  # gloo has no AVG: sum, then divide
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return value.item() / mesh.size()
