"""What the dry run needs to build and step a rank of a large job in one process: a fake process
group's store, fake tensors, three places where DTensor and DDP would otherwise look at values or
keep state across the simulated ranks, and two where building one rank would cost work for every
rank of the world."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from typing import Any, Iterator

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
    # Optional (own_share_only): without them a rank of a large world is built as before, only slower.
    PrivateName("torch.distributed.fsdp._fully_shard._fsdp_param._chunk_with_empty", ("tensor", "num_chunks", "dim"),
                optional=True),
    PrivateName("torch.distributed.device_mesh.DeviceMesh._init_one_process_group",
                ("sub_layout", "rank_map", "dim_name", "backend_override"), optional=True),
    PrivateName("torch.distributed._mesh_layout._MeshLayout.remap_to_tensor", ("self", "rank_map"), optional=True),
    PrivateName("torch.distributed._mesh_layout._FlatLayout", optional=True),  # 2.13's sub_layout (older: nest())
    PrivateName("torch.distributed.device_mesh.DeviceMesh._rank_map", instance=True, optional=True),
    PrivateName("torch.distributed.device_mesh.DeviceMesh._flatten_rank_map", instance=True, optional=True),
)

# Tensors with shapes and dtypes but no memory or values. Public only as torch._subclasses in
# torch 2.11-2.13 (torch.compile uses them internally).
__all__ = ["FakeTensorMode", "fake_store", "forget_sharding_caches", "own_share_only", "values_not_needed"]


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


class _LazyChunks(Sequence):
    """FSDP's `_chunk_with_empty(tensor, n, dim)` (torch.chunk, padded with empty tensors to n
    chunks), made when indexed: the same views and empty tensors, without n objects."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int):
        self.tensor, self.num_chunks, self.dim = tensor, num_chunks, dim
        self.size = tensor.size(dim)
        self.chunk = -(-self.size // num_chunks)  # torch.chunk's: ceil(size / n)

    def __len__(self) -> int:
        return self.num_chunks

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.num_chunks))]
        if not -self.num_chunks <= index < self.num_chunks:
            raise IndexError(f"chunk {index} of {self.num_chunks}")
        start = (index % self.num_chunks) * self.chunk
        if self.size == 0:  # torch.chunk: n empty views of the tensor's shape
            return self.tensor.narrow(self.dim, 0, 0)
        if start < self.size:
            return self.tensor.narrow(self.dim, start, min(self.chunk, self.size - start))
        return self[0].new_empty(0)  # FSDP's padding: the ranks past the tensor's rows hold nothing


def _own_process_group(original):
    """DeviceMesh's `_init_one_process_group`, making only the group of this rank's row of the dim
    (the other rows' groups are the other ranks', which are not simulated). A dim that spans the
    world is the default group, as in `original`. None for a torch whose method differs."""
    import torch.distributed as dist
    from torch.distributed._mesh_layout import _FlatLayout, _MeshLayout  # noqa: F401 (2.13's layouts, else no patch)

    if list(inspect.signature(original).parameters) != ["sub_layout", "rank_map", "dim_name", "backend_override"]:
        return None  # another torch's mesh: built as it builds it

    def init_one_process_group(sub_layout, rank_map: torch.Tensor, dim_name: str, backend_override) -> str | None:
        if sub_layout.numel() == dist.get_world_size() and tuple(backend_override) == (None, None):
            return original(sub_layout, rank_map, dim_name, backend_override)
        rows = _MeshLayout([sub_layout]).remap_to_tensor(rank_map)
        rows = rows.reshape(-1, rows.size(-1))
        mine = rows[(rows == dist.get_rank()).any(dim=-1)]
        if len(mine) == 0:
            return None
        backend, options = backend_override  # (None, None) in a dry run: no timeout to carry over
        return dist.new_group(ranks=mine[0].tolist(), backend=backend, pg_options=options,
                              group_desc=f"mesh_{dim_name}").group_name

    return staticmethod(init_one_process_group)


class _SharedRankMap(tuple):
    """A DeviceMesh's `_flatten_rank_map` (every rank of the world, in mesh order), one object
    for every mesh cut from the same root: DTensor compares meshes op after op, and comparing two
    copies of a million ranks takes milliseconds where comparing one object with itself takes none."""

    def __eq__(self, other):
        return self is other or tuple.__eq__(self, other)

    def __ne__(self, other):
        return not self == other

    __hash__ = tuple.__hash__


def _sharing_rank_maps(original):
    """DeviceMesh.__init__, then the mesh's rank map replaced by the one its root's meshes share."""
    shared: dict[int, tuple[torch.Tensor, _SharedRankMap]] = {}  # id of the root's rank-map tensor

    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        rank_map, flat = getattr(self, "_rank_map", None), getattr(self, "_flatten_rank_map", None)
        if rank_map is None or not isinstance(flat, tuple):
            return  # a build that keeps them otherwise: its own comparisons
        kept = shared.get(id(rank_map))
        if kept is None or kept[0] is not rank_map:
            kept = shared[id(rank_map)] = (rank_map, _SharedRankMap(flat))
        self._flatten_rank_map = kept[1]

    return init


def _slices_made_once(original):
    """DeviceMesh.__getitem__, keeping each slice: FSDP slices its mesh for every parameter, and
    each new mesh object copies the world's rank map (a million ranks: a fifth of a second)."""
    made: dict[tuple[int, Any], tuple[Any, Any]] = {}  # (id of the mesh, dim names) -> (mesh, slice)

    def getitem(self, names):
        key = (id(self), names if isinstance(names, str) else tuple(names))
        kept = made.get(key)
        if kept is None or kept[0] is not self:
            kept = made[key] = (self, original(self, names))
        return kept[1]

    return getitem


@contextlib.contextmanager
def own_share_only() -> Iterator[None]:
    """Builds one rank of an N-rank world without work for each of the N ranks, for the ranks
    are alike: FSDP cuts every parameter into N chunks (all but the first few thousand empty
    tensors) to keep its rank's, and DeviceMesh creates the process group of every row of every
    mesh dim (N / size groups each) to join one. Under the fake process group only the rank's
    own chunk and groups are ever used; this makes only those, so a world of a million ranks is
    built in seconds instead of hours (docs/memory.md). The meshes cut from one root also share
    one rank map (_SharedRankMap), and a slice of a mesh is made once. None of it has a public
    switch; where a torch build lacks the names it builds as before."""
    try:
        import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param
        from torch.distributed.device_mesh import DeviceMesh

        chunk, init_group, init = fsdp_param._chunk_with_empty, DeviceMesh._init_one_process_group, DeviceMesh.__init__
        own_group, getitem = _own_process_group(init_group), DeviceMesh.__getitem__
    except (ImportError, AttributeError):
        own_group = None
    if own_group is None:
        yield
        return
    fsdp_param._chunk_with_empty = _LazyChunks
    DeviceMesh._init_one_process_group = own_group
    DeviceMesh.__init__ = _sharing_rank_maps(init)
    DeviceMesh.__getitem__ = _slices_made_once(getitem)
    try:
        yield
    finally:
        fsdp_param._chunk_with_empty = chunk
        DeviceMesh._init_one_process_group = staticmethod(init_group)
        DeviceMesh.__init__ = init
        DeviceMesh.__getitem__ = getitem
