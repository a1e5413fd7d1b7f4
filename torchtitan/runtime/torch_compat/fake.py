"""What the dry run needs to build and step a rank of a large job in one process: a fake process
group's store, fake tensors, and three places where DTensor and DDP would otherwise look at values
or keep state across the simulated ranks."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from torchtitan.runtime.torch_compat import CPU_AND_GPU_CHECK, CPU_AND_PRESENT_IN_2_11, PrivateName

PRIVATE_NAMES = (
    PrivateName("torch.testing._internal.distributed.fake_pg.FakeStore", checked=CPU_AND_GPU_CHECK),
    PrivateName("torch._subclasses.fake_tensor.FakeTensorMode", ("allow_fallback_kernels", "allow_non_fake_inputs"),
                checked=CPU_AND_GPU_CHECK),
    PrivateName("torch.nn.parallel.distributed._verify_param_shape_across_processes", ("process_group", "tensors"),
                checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName("torch.distributed.tensor._sharding_prop.detect_fake_mode", ("inputs",), checked=CPU_AND_GPU_CHECK),
    PrivateName("torch.distributed.tensor.DTensor._op_dispatcher", checked=CPU_AND_GPU_CHECK),
    PrivateName("torch.distributed.tensor._sharding_prop.ShardingPropagator._propagate_tensor_meta_cached",
                checked=CPU_AND_GPU_CHECK),
    PrivateName("torch.distributed.tensor._redistribute.clear_redistribute_planner_cache", (), checked=CPU_AND_GPU_CHECK),
    # Optional: the seam clears them where they exist (they moved between torch versions).
    PrivateName("torch.distributed.tensor._redistribute._gen_transform_infos", optional=True, checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName("torch._C._clear_DTensor_sharding_propagator_cache", optional=True, checked=CPU_AND_PRESENT_IN_2_11),
)

# Tensors with shapes and dtypes but no memory or values. Public only as torch._subclasses in
# torch 2.11-2.13 (torch.compile uses them internally).
__all__ = ["FakeTensorMode", "fake_store", "forget_sharding_caches", "values_not_needed"]


def fake_store() -> torch.distributed.Store:
    """The store of the "fake" process-group backend, whose collectives do nothing: one process
    stands for a rank of any world size. It ships with torch's test utilities only."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def forget_sharding_caches() -> None:
    """DTensor caches sharding decisions by mesh; the next rank simulated builds equal meshes over
    new process groups, and a cached decision would name the destroyed ones. The caches have no
    public way to be cleared."""
    from torch.distributed.tensor import DTensor, _redistribute

    getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", lambda: None)()  # the C++ dispatch's
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    getattr(_redistribute._gen_transform_infos, "cache_clear", lambda: None)()


@contextlib.contextmanager
def values_not_needed() -> Iterator[None]:
    """Turns off two places that read tensor values or pick up the active fake mode, which the
    dry run's fake tensors cannot serve; neither has a public switch.

    DDP compares its parameters' shapes across ranks by their values before its first forward;
    in a world of one real process there is nothing to compare.

    DTensor derives an op's global output shape by running it on fake tensors of global shape, in
    the fake mode it finds active, else a fresh one. Finding the dry run's, it would allocate them
    where the memory tracker counts them (a whole vocabulary's logits in loss parallelism's
    handlers): a fresh mode, as in a real run, keeps them out of the count."""
    import torch.distributed.tensor._sharding_prop as sharding_prop
    import torch.nn.parallel.distributed as ddp

    verify = ddp._verify_param_shape_across_processes
    ddp._verify_param_shape_across_processes = lambda *args, **kwargs: None
    detect = sharding_prop.detect_fake_mode
    sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ddp._verify_param_shape_across_processes = verify
        sharding_prop.detect_fake_mode = detect
