"""Autograd state that activation offload (parallelisms/activation_offload.py) reads: a tensor's
version counter, which every in-place op bumps. Two saves of one tensor share a host copy only
when nothing wrote to it in between; with saved-tensor hooks autograd no longer checks versions
itself. torch 2.11-2.13 expose the counter only as the private `Tensor._version`. And the end of
a backward, which DDP's same-layout reduction (parallelisms/ddp_reduction.py) waits for."""

from __future__ import annotations

from typing import Callable

import torch

from torchtitan.runtime.torch_compat import CPU, PrivateName

PRIVATE_NAMES = (
    PrivateName("torch.Tensor._version", checked=CPU),
    PrivateName("torch.autograd.Variable._execution_engine.queue_callback", checked=CPU),
)


def tensor_version(t: torch.Tensor) -> int:
    return t._version


def after_backward(fn: Callable[[], None]) -> None:
    """Runs `fn` when the backward now running ends, after every other callback queued for that
    end during the backward (DDP queues the copy of its reduced buckets into `.grad` only after
    its comm hook returns). Only the autograd engine's private `queue_callback` (torch 2.11-2.13)
    reaches the end of a backward from inside it."""
    engine = torch.autograd.Variable._execution_engine
    engine.queue_callback(lambda: engine.queue_callback(fn))
