"""Losses shared by model families.

A family's loss function returns the mean over the labels that carry a loss (not IGNORE_INDEX)
and 0 when none does; the trainer weights it by the micro-batch's share of the step's valid
tokens (trainer/loss_tokens.py)."""

import torch
import torch.nn.functional as F

from torchtitan.datasets.text_dataset import IGNORE_INDEX


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over (batch, seq)'s valid labels, computed in fp32 whatever the
    logits' dtype. Summed, then divided by the count clamped at 1: a micro-batch without a valid
    label (all masked) gives 0 and zero gradients, not 0 / 0 (what the plain mean gives)."""
    labels = labels.flatten(0, 1)
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels, reduction="sum", ignore_index=IGNORE_INDEX)
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)
