"""Operators PyTorch keeps private: the fused attention kernels (called directly by ring attention,
saved by op-level activation checkpointing), the TP reduce-scatter and FlexAttention as the
checkpoint policy sees them, and oneDNN's bf16 probe. (The grouped matmul needs no seam: its
public wrapper torch.nn.functional.grouped_mm is in torch 2.11 and 2.13.)"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.runtime.torch_compat import CPU, CPU_AND_GPU_CHECK, CPU_AND_PRESENT_IN_2_11, PrivateName

_ATEN = "torch.ops.aten"
PRIVATE_NAMES = (
    # Ring attention's block kernels: the log-sum-exp they return (and the backwards that take it)
    # are what merging blocks needs; F.scaled_dot_product_attention returns neither.
    PrivateName(f"{_ATEN}._scaled_dot_product_flash_attention_for_cpu", checked=CPU),
    PrivateName(f"{_ATEN}._scaled_dot_product_flash_attention_for_cpu_backward", checked=CPU),
    PrivateName(f"{_ATEN}._scaled_dot_product_flash_attention", checked=CPU_AND_GPU_CHECK),
    PrivateName(f"{_ATEN}._scaled_dot_product_flash_attention_backward", checked=CPU_AND_GPU_CHECK),
    PrivateName(f"{_ATEN}._scaled_dot_product_efficient_attention", checked=CPU_AND_GPU_CHECK),
    PrivateName(f"{_ATEN}._scaled_dot_product_efficient_attention_backward", checked=CPU_AND_GPU_CHECK),
    # Optional: cuDNN attention is in CUDA builds with cuDNN only.
    PrivateName(f"{_ATEN}._scaled_dot_product_cudnn_attention", optional=True),
    PrivateName("torch.ops._c10d_functional.reduce_scatter_tensor"),
    PrivateName("torch._higher_order_ops.flex_attention", checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName("torch.ops.mkldnn._is_mkldnn_bf16_supported", checked=CPU_AND_PRESENT_IN_2_11),
)

_aten = torch.ops.aten

# The fused attention kernels sdpa dispatches to, by backend; torch has no public name for them.
flash_attention_cpu = _aten._scaled_dot_product_flash_attention_for_cpu
flash_attention_cpu_backward = _aten._scaled_dot_product_flash_attention_for_cpu_backward
flash_attention_cuda = _aten._scaled_dot_product_flash_attention
flash_attention_cuda_backward = _aten._scaled_dot_product_flash_attention_backward
efficient_attention_cuda = _aten._scaled_dot_product_efficient_attention
efficient_attention_cuda_backward = _aten._scaled_dot_product_efficient_attention_backward


def default_overloads(namespace: Any, names: tuple[str, ...]) -> set:
    """The default overloads of the ops of `namespace` (torch.ops.aten, ...) named `names` that this
    build has: attention kernels and collectives come and go between torch builds."""
    packets = (getattr(namespace, name, None) for name in names)
    return {packet.default for packet in packets if packet is not None}


def tp_reduce_scatter_ops() -> set:
    """The functional reduce-scatter TP's row-wise layers end in, as a checkpoint policy sees it
    (an op of the private `_c10d_functional` library)."""
    return default_overloads(torch.ops._c10d_functional, ("reduce_scatter_tensor",))


def flex_attention_op() -> Any:
    """FlexAttention's higher-order op, which a checkpoint policy sees instead of an aten op; the
    public torch.nn.attention.flex_attention is the function, not the op."""
    return torch._higher_order_ops.flex_attention


def onednn_has_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU; torch.backends has no public probe."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
