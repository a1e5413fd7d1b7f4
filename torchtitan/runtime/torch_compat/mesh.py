"""DeviceMesh views the public API cannot make: a flattened dim, two views joined."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from torchtitan.runtime.torch_compat import CPU_AND_PRESENT_IN_2_11, PrivateName

PRIVATE_NAMES = (
    PrivateName("torch.distributed.device_mesh.DeviceMesh._flatten", ("self", "mesh_dim_name"), checked=CPU_AND_PRESENT_IN_2_11),
    # Optional: older builds lack it and `join` falls back to slicing.
    PrivateName("torch.distributed.device_mesh.DeviceMesh._concatenate", ("device_mesh_list",), checked=CPU_AND_PRESENT_IN_2_11),
)


def flatten(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """`mesh`'s dims as one dim called `name` (its own process group). torch 2.11-2.13 have no
    public way to make a flattened view; `init_device_mesh` would make a new world mesh."""
    return mesh._flatten(mesh_dim_name=name)


def join(world: DeviceMesh, outer: DeviceMesh, inner: DeviceMesh) -> DeviceMesh:
    """The 2-D mesh (outer, inner) of two 1-D views of `world`, reusing their process groups.
    No public API joins views; without `_concatenate` the flattened dim is sliced back out of the
    world mesh (deprecated where `_concatenate` exists)."""
    if hasattr(DeviceMesh, "_concatenate"):
        return DeviceMesh._concatenate([outer, inner])
    return world[(outer.mesh_dim_names[0], inner.mesh_dim_names[0])]
