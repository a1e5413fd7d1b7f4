"""Gradient clipping to one global norm over every parallelism's shards."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def clip_grad_norm_(
    parameters: list[torch.nn.Parameter], max_norm: float, pp_mesh: DeviceMesh | None = None,
    uncounted: Sequence[torch.nn.Parameter] = (),
) -> torch.Tensor:
    """Clips gradients to a global L2 norm and returns that norm.

    With DTensor gradients (FSDP/TP) the norm is reduced over every mesh dim the gradients are
    sharded on. Plain-tensor gradients (parameters no parallelism touched, e.g. the norms under
    TP without sequence parallelism) are the same on every rank and are added once. With
    pipeline stages each rank holds only its stages' gradients, so the squared norms are also
    summed across pp. `uncounted` parameters (a second copy of a tied weight) are clipped but
    left out of the norm. max_norm <= 0 only measures.
    """
    params = [p for p in parameters if p.grad is not None]
    # foreach kernels cannot mix DTensors with plain tensors, nor DTensors of different meshes (under
    # TP without sequence parallelism, FSDP/HSDP leaves the norms on a mesh without the tp dim).
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    skip = {id(p) for p in uncounted}
    norms = []
    for group in ([p for p in g if id(p) not in skip] for g in groups.values()):
        if not group:
            continue
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0, foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:  # no parameter received a gradient (a pp rank still joins the sum below)
        total = torch.zeros((), device=pp_mesh.device_type if pp_mesh is not None else "cpu")
    else:
        total = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
    if pp_mesh is not None:
        total = total**2
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
        total = total.sqrt()
    if max_norm > 0:
        # One factor for every element whatever its placement, so the local shards are scaled
        # directly: a foreach over DTensors of mixed placements costs DTensor's sharding
        # propagation seconds of CPU per process on the first step (a third of a short 3-D run).
        # clip_grads_with_norm_ scales the `.grad` of the tensors it is given: here leaf aliases
        # of the local shards, each holding its shard as its gradient.
        holders = []
        for p in params:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            holder = local.detach()
            holder.grad = local
            holders.append(holder)
        torch.nn.utils.clip_grads_with_norm_(holders, max_norm, total)
    return total
