"""Gradient clipping (parallelisms/grad_clip.clip_grad_norm_) in this process: the global norm
and the clipped gradients equal torch's own clip_grad_norm_ on whole tensors, for plain tensors and
for DTensor gradients of two meshes (clipped through their local shards), and max_norm 0 only
measures. The layouts' grad norms are compared with one process in the parity suites."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tests.tolerances import assert_reordered
from torchtitan.parallelisms.grad_clip import clip_grad_norm_

# A global norm sums the squares of parameters()'s 55 elements (per tensor, then the tensors' norms),
# in torch's order or ours; a clipped gradient is scaled by max_norm over that norm.
NORM_SUMS = 32 + 5 + 18 + 3


@pytest.fixture
def meshes():
    """Two one-rank meshes of a one-process gloo group (as FSDP's and TP's differ under TP)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)), init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    finally:
        dist.destroy_process_group()


def parameters(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((8, 4), (5,), (3, 3, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_plain_gradients_are_clipped_as_torch_clips_them(max_norm):
    ours, reference = parameters(0), parameters(0)
    norm = clip_grad_norm_(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(reference, max_norm)
    assert_reordered(norm, expected, NORM_SUMS)
    for p, q in zip(ours, reference):
        assert_reordered(p.grad, q.grad, NORM_SUMS)
    assert max_norm > 1e5 or torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ours])) <= max_norm * 1.0001


def test_dtensor_gradients_of_two_meshes_and_plain_ones_are_clipped_together(meshes):
    dp, ab = meshes
    reference = parameters(1)
    ours = parameters(1)
    placements = [(dp, [Shard(0)]), (ab, [Replicate(), Shard(0)]), (None, None)]
    for p, (mesh, place) in zip(ours, placements):
        if mesh is not None:
            p.grad = distribute_tensor(p.grad, mesh, place)
    norm = clip_grad_norm_(ours, 0.5)
    expected = torch.nn.utils.clip_grad_norm_(reference, 0.5)
    assert_reordered(norm, expected, NORM_SUMS)
    assert expected > 0.5  # the gradients were really scaled
    for p, q in zip(ours, reference):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert_reordered(grad, q.grad, NORM_SUMS)


def test_max_norm_zero_only_measures():
    params = parameters(2)
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm_(params, 0.0)
    assert_reordered(norm, torch.linalg.vector_norm(torch.cat([g.flatten() for g in before])), NORM_SUMS)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))


def test_uncounted_parameters_are_clipped_but_not_counted():
    """The second copy of a tied weight: left out of the norm, scaled like the rest."""
    params = parameters(3)
    twin = params[0]
    counted = clip_grad_norm_(parameters(3)[1:], 1e6)
    norm = clip_grad_norm_(params, 0.1, uncounted=[twin])
    assert_reordered(norm, counted, NORM_SUMS)
    expected = parameters(3)[0].grad * (0.1 / (counted + 1e-6))
    assert_reordered(twin.grad, expected, NORM_SUMS)
