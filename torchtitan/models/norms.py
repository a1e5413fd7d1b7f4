"""Normalization layers shared by model families, chosen by `model.norm_type`."""

import torch
from torch import nn


def build_norm(norm_type: str, dim: int, eps: float = 1e-6) -> nn.Module:
    """Returns the normalization layer named by `norm_type` over the last `dim` features."""
    if norm_type in ("rmsnorm", "fused_rmsnorm"):  # the same math; compile fuses it
        return nn.RMSNorm(dim, eps=eps)
    if norm_type == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=False)
    if norm_type == "np_layernorm":  # no learnable parameters
        return nn.LayerNorm(dim, eps=eps, elementwise_affine=False, bias=False)
    raise ValueError(f"unknown norm_type {norm_type!r}; expected rmsnorm, layernorm or np_layernorm")


def reset_norm(norm: nn.Module) -> None:
    """Re-initialises a norm's parameters in place (weights to one)."""
    if getattr(norm, "weight", None) is not None:
        with torch.no_grad():
            nn.init.ones_(norm.weight)
