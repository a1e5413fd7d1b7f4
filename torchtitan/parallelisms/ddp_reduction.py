"""DDP's gradient all-reduce in one bucket layout on every step, so that a resumed run repeats the
uninterrupted one bit for bit.

PyTorch's DDP reduces the first backward of a process in one bucket that holds every parameter
in registration order, then rebuilds its buckets in the order the gradients arrived and keeps
that layout for the rest of the run. Over more than two ranks, the sum an all-reduce computes
for an element depends on where in the bucket the element lies (a ring adds the ranks' values in
an order that depends on the element's chunk), so the first step of a process came out a few
last bits away from the same step of a process that had rebuilt already: a run resumed from a
checkpoint left the losses of the run that never stopped.

`apply_same_layout_reduction` registers a comm hook that leaves the first backward's bucket
unreduced and, once that backward has ended, has DDP rebuild its buckets at once and reduces the
gradients bucket by bucket in the new layout, as every later step does. Over two ranks the order
cannot matter (a + b = b + a), and PyTorch's own reduction is left alone.
"""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations as objects.
import torch
import torch.distributed as dist
from torch import nn

from torchtitan.runtime.torch_compat import autograd as torch_compat_autograd
from torchtitan.runtime.torch_compat import composable as torch_compat_composable


class SameLayoutReduction:
    """The comm hook's state: the replicated module, its process group, and whether the first
    backward's gradients have been reduced (in the rebuilt layout) yet."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup):
        self.module = module
        self.group = group
        self.world_size = group.size()
        self.first_scheduled = False
        self.first_reduced = False


def apply_same_layout_reduction(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Makes composable DDP on `module` reduce its first step in the layout of the later ones."""
    module.register_comm_hook(SameLayoutReduction(module, group), same_layout_allreduce)


def same_layout_allreduce(state: SameLayoutReduction, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The mean of the bucket over the ranks (each rank's values divided by their number, then
    summed, as PyTorch's own reduction does); on the first backward, the bucket comes back as it
    is and its reduction waits for the end of the backward (`_reduce_in_rebuilt_buckets`)."""
    buffer = bucket.buffer()
    if not state.first_reduced:
        if not state.first_scheduled:
            state.first_scheduled = True
            torch_compat_autograd.after_backward(lambda: _reduce_in_rebuilt_buckets(state))
        unreduced: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        unreduced.set_result(buffer)
        return unreduced
    buffer.div_(state.world_size)
    work = dist.all_reduce(buffer, group=state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _reduce_in_rebuilt_buckets(state: SameLayoutReduction) -> None:
    """After the first backward (DDP has put the rank's own gradients back into `.grad`): DDP
    rebuilds its buckets now rather than at the next forward, and each new bucket is filled,
    divided and summed here exactly as the hook does it on later steps."""
    ddp = torch_compat_composable.ddp_of(state.module)
    for buffer, params in torch_compat_composable.rebuild_ddp_buckets(ddp):
        views = list(_bucket_views(buffer, params))
        for view, p in zip(views, params):
            view.copy_(p.grad)
        buffer.div_(state.world_size)
        dist.all_reduce(buffer, group=state.group)
        for view, p in zip(views, params):
            p.grad.copy_(view)
    state.first_reduced = True


def _bucket_views(buffer: torch.Tensor, params: list[torch.Tensor]):
    """Each parameter's place in a bucket, as DDP lays it out: one after another, in the
    parameter's own strides where its memory is dense, else row-major."""
    offset = 0
    for p in params:
        if _dense(p):
            yield buffer.as_strided(p.shape, p.stride(), buffer.storage_offset() + offset)
        else:
            yield buffer.narrow(0, offset, p.numel()).view(p.shape)
        offset += p.numel()


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill a block of memory without gaps or overlaps, in any dim order."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True
