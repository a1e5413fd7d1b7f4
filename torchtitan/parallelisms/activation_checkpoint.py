"""Activation checkpointing of transformer blocks: recompute activations in backward to save memory.

Works on any model that keeps its blocks in `model.layers` (an nn.ModuleDict keyed by block index).
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

logger = logging.getLogger(__name__)


def apply_ac(model: nn.Module, mode: str, selective_ac_option: str) -> None:
    """Wraps transformer blocks so their activations are recomputed in backward.

    full: every block. selective with integer k: every k-th block (block index % k == 0),
    trading compute for memory in between the two extremes. The choice depends only on the
    block's own index, so it needs no counter and is the same whatever the pipeline split.
    """
    every = 1 if mode == "full" else int(selective_ac_option)
    wrapped = 0
    for name, block in list(model.layers.named_children()):
        if int(name) % every == 0:
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
            wrapped += 1
    logger.info(f"applied {mode} activation checkpointing to {wrapped} of {len(model.layers)} blocks")
