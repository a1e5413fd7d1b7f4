"""LR scheduler state the public API cannot set."""

from __future__ import annotations

from torch.optim.lr_scheduler import LRScheduler

from torchtitan.runtime.torch_compat import PrivateName

PRIVATE_NAMES = (PrivateName("torch.optim.lr_scheduler.LRScheduler._last_lr", instance=True),)


def set_last_lr(scheduler: LRScheduler, lrs: list[float]) -> None:
    """Makes `scheduler.get_last_lr()` return `lrs`, which it reads from `_last_lr`. The public way
    (a `step()` from the epoch before) would warn that the optimizer has not stepped yet when a
    checkpoint is loaded before the first step."""
    scheduler._last_lr = lrs
