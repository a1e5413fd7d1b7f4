"""What the host-read audit (torchtitan/observability/host_reads.py) needs to see every op a step
runs: a Python dispatch mode, the ops that hand data to the host, the leaves of an op's
arguments, and the tensor subclasses among them. torch 2.11-2.13 expose the dispatch-mode base
class and pytree only under private module names (torch.compile, FSDP and DTensor use them)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchtitan.runtime.torch_compat import CPU, PrivateName

aten = torch.ops.aten

PRIVATE_NAMES = (
    PrivateName("torch.utils._python_dispatch.TorchDispatchMode", checked=CPU),
    PrivateName("torch.utils._pytree.tree_leaves", ("tree",), checked=CPU),
    PrivateName("torch._subclasses.fake_tensor.FakeTensor", checked=CPU),
    PrivateName("torch.ops.aten._local_scalar_dense", checked=CPU),
    PrivateName("torch.ops.aten._unique2", checked=CPU),
    PrivateName("torch.ops.aten._index_put_impl_", checked=CPU),
)

__all__ = ["FakeTensor", "TorchDispatchMode", "HOST_READ_OPS", "BOOLEAN_MASK_OPS", "REPEAT_INTERLEAVE_OPS",
           "tree_leaves"]

# Ops that give the host a value the device computed, or whose output shape depends on the data
# (the host must read a count before it can allocate the result), by the name a report gives.
HOST_READ_OPS = {
    aten._local_scalar_dense.default: "item",  # .item(), bool(t), float(t), int(t), if t:
    aten.nonzero.default: "nonzero",  # also argwhere
    aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique_consecutive",
    aten.equal.default: "equal",
    aten.bincount.default: "bincount",
}
# Reads unless the caller gives output_size.
REPEAT_INTERLEAVE_OPS = (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor)
# Reads when an index is a boolean mask (x[mask], x[mask] = v: the mask's true entries are counted).
BOOLEAN_MASK_OPS = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                    aten._index_put_impl_.default)
