"""Autograd state that activation offload (parallelisms/activation_offload.py) reads: a tensor's
version counter, which every in-place op bumps. Two saves of one tensor share a host copy only
when nothing wrote to it in between; with saved-tensor hooks autograd no longer checks versions
itself. torch 2.11-2.13 expose the counter only as the private `Tensor._version`."""

from __future__ import annotations

import torch

from torchtitan.runtime.torch_compat import CPU, PrivateName

PRIVATE_NAMES = (PrivateName("torch.Tensor._version", checked=CPU),)


def tensor_version(t: torch.Tensor) -> int:
    return t._version
