"""The per-expert matmul loop (torchtitan/models/moe.py's `grouped_mm` fallback) as one custom
operator, for compiled blocks in the dropless mode.

The loop splits the tokens by their expert counts, sizes read to the host. Traced by dynamo, those
sizes become unbacked symbols, and inductor (PyTorch 2.13, CPU) cannot lower the slices of a split by
them; `F.grouped_mm`, which takes the counts on the device, compiles only in bf16. Inside a custom
operator the loop stays opaque: the graph holds one node whose output shape is known (N, out), and
the counts are read when the node runs. The cost is a second read in backward (an operator cannot
hand its split sizes to its backward except as a tensor): the eager loop reads once per forward.

The forward and backward are the products autograd computes for the eager loop (`xe @ we.T`; its
gradients `ge @ we` and `ge.T @ xe`), so compiled and eager training agree.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("torchtitan::expert_matmul_loop", mutates_args=())
def expert_matmul_loop(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x (N, in) grouped by expert (`counts[e]` rows each), weight (E, out, in) -> (N, out)."""
    return torch.cat([xe @ we.T for xe, we in zip(x.split(counts.tolist()), weight.unbind(0))])


@expert_matmul_loop.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1])


@torch.library.custom_op("torchtitan::expert_matmul_loop_backward", mutates_args=())
def expert_matmul_loop_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of x and of the stacked weight (built once, not one full-size zero per expert)."""
    sizes = counts.tolist()
    grad_x, grad_w = [], []
    for ge, xe, we in zip(grad.split(sizes), x.split(sizes), weight.unbind(0)):
        grad_x.append(ge @ we)
        grad_w.append(ge.T @ xe)
    return torch.cat(grad_x), torch.stack(grad_w)


@expert_matmul_loop_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
      counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _save(ctx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    x, weight, counts = ctx.saved_tensors
    grad_x, grad_w = expert_matmul_loop_backward(grad, x, weight, counts)
    return grad_x, grad_w, None


expert_matmul_loop.register_autograd(_backward, setup_context=_save)
