"""A weight shared by the first and the last pipeline stage (tied input and output embeddings).

The embedding lives on the first stage and the output projection on the last, usually on two
different ranks, so each keeps its own copy of the shared matrix. The copies stay one weight:
they start equal (the first stage's values are sent to the last), their gradients are summed
across the two before clipping (a tied weight's gradient is the sum of both uses), and so the
optimizer, which sees the same gradient and state on both sides, keeps them equal. The gradient
norm counts the weight once. With V-shaped schedules both stages are on the same rank and all
of this is local.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class TiedWeights:
    """`first` / `last`: (module, attribute) of the weight on this rank's first / last stage, or
    None where this rank does not run that stage. `owners`: the pp ranks of the two stages."""

    def __init__(self, first: tuple[nn.Module, str] | None, last: tuple[nn.Module, str] | None,
                 owners: tuple[int, int], world_mesh: DeviceMesh):
        self.first, self.last = first, last
        self.group, self.src = None, None
        if owners[0] != owners[1]:
            self.group, self.src = self._pair_group(owners, world_mesh)

    @staticmethod
    def _pair_group(owners: tuple[int, int], world_mesh: DeviceMesh):
        """The two-rank group (first owner, last owner) of this rank's column of the mesh. Every
        rank creates every column's group, in the same order, as new_group requires."""
        names = list(world_mesh.mesh_dim_names)
        ranks = world_mesh.mesh.movedim(names.index("pp"), 0).reshape(world_mesh.mesh.shape[names.index("pp")], -1)
        mine = None
        for column in range(ranks.shape[1]):
            pair = [int(ranks[owners[0], column]), int(ranks[owners[1], column])]
            group = dist.new_group(pair)
            if dist.get_rank() in pair:
                mine = (group, pair[0])
        return mine if mine is not None else (None, None)

    def _weight(self, where: tuple[nn.Module, str] | None) -> nn.Parameter | None:
        # Looked up each time: materialising the model may replace the parameter objects.
        return getattr(where[0], where[1]).weight if where is not None else None

    @property
    def uncounted(self) -> list[nn.Parameter]:
        """The last stage's copy: clipped like every weight, but left out of the norm."""
        weight = self._weight(self.last)
        return [weight] if weight is not None else []

    @torch.no_grad()
    def sync_values(self) -> None:
        """Gives the last stage's copy the first stage's values (after initialisation)."""
        first, last = self._weight(self.first), self._weight(self.last)
        if first is not None and last is not None:
            _local(last).copy_(_local(first))
        elif self.group is not None:
            dist.broadcast(_local(first if first is not None else last), src=self.src, group=self.group)

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Sums the two copies' gradients (after the last backward of a step, before clipping)."""
        first, last = self._weight(self.first), self._weight(self.last)
        if first is not None and last is not None:
            total = _local_grad(first) + _local_grad(last)
            _local_grad(first).copy_(total)
            _local_grad(last).copy_(total)
        elif self.group is not None:
            dist.all_reduce(_local_grad(first if first is not None else last), group=self.group)


def _local_grad(weight: nn.Parameter) -> torch.Tensor:
    """This rank's part of `weight`'s gradient, laid out like the weight itself. Under tensor
    parallelism the vocabulary-sharded embedding's gradient arrives as a pending sum over the tp
    ranks (Partial), not sharded like its weight; the two stages' copies only line up shard for
    shard once it is redistributed to the weight's placements."""
    grad = weight.grad
    if isinstance(grad, DTensor) and grad.placements != weight.placements:
        grad = weight.grad = grad.redistribute(grad.device_mesh, weight.placements)
    return _local(grad)
