"""ZeRO-1: data-parallel replicas share out the optimizer state instead of each holding all of it.

Replicas (the `dp_replicate` ranks: DDP, or HSDP's outer dim) hold the same parameters and,
after their gradient all-reduce, the same gradients, so every one of them would compute the same
optimizer update. Under ZeRO-1 each parameter has one owner among the replicas: only the owner
keeps its optimizer state (Adam's two moments) and updates it, then sends the new values to the
other replicas. Per rank the optimizer state shrinks to about 1/N; gradients and the update are
those of plain data parallelism, so the losses do not change.

Why not PyTorch's `ZeroRedundancyOptimizer`: it broadcasts `param.data`, which fails for DTensor
parameters (tensor parallelism, HSDP, FSDP-based replication under pipeline parallelism), and its
state dict is indexed by position and must be gathered on one rank. Here the owners' optimizers
are ordinary optimizers over real parameters, checkpointed by parameter name through DCP like any
other, so a ZeRO-1 checkpoint loads under any layout (each rank writes the state it owns).
The only collective is one broadcast per owner and dtype after each step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def assign_owners(sizes: list[int], n_owners: int) -> list[int]:
    """An owner in range(n_owners) for each of `sizes` (elements per parameter): largest first,
    each to the least-loaded owner (lowest index on ties), so loads differ by at most one
    parameter. Deterministic, so every replica computes the same assignment."""
    load = [0] * n_owners
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(n_owners), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += sizes[i]
    return owners


class ReplicaOwnership:
    """Which of the model parts' parameters this replica owns, and the broadcast after each step.

    Parameters are those of `model_parts` in order, weighed by their GLOBAL number of elements:
    every rank computes the same owners, not only the replicas of one shard. Muon needs that: an
    owner gathers each matrix's update over its FSDP/TP shard group, so every rank of that group must
    own the same parameters, and local sizes differ between the ranks of unevenly sharded matrices.
    """

    def __init__(self, model_parts: list[nn.Module], replicate_mesh: DeviceMesh):
        self.group = replicate_mesh.get_group()
        self.size = replicate_mesh.size()
        self.rank = replicate_mesh.get_local_rank()
        self.params = [p for part in model_parts for p in part.parameters() if p.requires_grad]  # not a frozen base
        self.owners = assign_owners([p.numel() for p in self.params], self.size)
        self._owned = {id(p) for p, owner in zip(self.params, self.owners) if owner == self.rank}

    def owns(self, param: nn.Parameter) -> bool:
        return id(param) in self._owned

    @torch.no_grad()
    def broadcast_updates(self) -> None:
        """Every replica receives each owner's updated parameters: one flat broadcast per owner
        and dtype (the optimizer is built after the model is materialised, so the parameter
        objects seen here are the trained ones)."""
        for owner in range(self.size):
            src = dist.get_global_rank(self.group, owner)
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for p, o in zip(self.params, self.owners):
                if o == owner:
                    local = _local(p)
                    by_dtype.setdefault(local.dtype, []).append(local)
            for dtype, tensors in by_dtype.items():
                if owner == self.rank:
                    flat = torch.cat([t.reshape(-1) for t in tensors])
                else:  # filled by the broadcast
                    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
                dist.broadcast(flat, src=src, group=self.group)
                if owner != self.rank:
                    offset = 0
                    for t in tensors:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()
