"""Tensors with shapes but no values: the dry run's fake tensors (torchtitan/estimation).

Code whose shapes depend on values (how many tokens each expert of an MoE layer receives) asks
`is_fake` and, on such tensors, takes tokens to spread evenly (`balanced_counts`): the dry run's
estimate of an MoE layer is that of perfectly balanced routing.
"""

from __future__ import annotations

import torch


def is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return _is_fake(t)


def balanced_counts(total: int, n: int, device: torch.device) -> torch.Tensor:
    """`total` tokens spread as evenly as they go over `n` experts (or ranks)."""
    return torch.tensor([total // n + (i < total % n) for i in range(n)], device=device)
