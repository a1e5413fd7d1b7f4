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


class _GroupedMatmulShapes(torch.autograd.Function):
    """What `torch._grouped_mm` allocates, for fake tensors in a dtype its shape function refuses
    (it takes bf16 only, while CPU runs it in fp32): an (N, out) result holding on to x and the
    weight for backward, and gradients of their shapes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight_t)
        return x.new_empty(x.shape[0], weight_t.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight_t = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight_t)


def grouped_matmul_shapes(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    return _GroupedMatmulShapes.apply(x, weight_t)
