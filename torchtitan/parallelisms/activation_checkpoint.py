"""Activation checkpointing of transformer blocks: recompute activations in backward to save memory.

Three granularities, from most memory saved to least compute repeated:
- full: every block keeps only its input; all of its forward is rerun in backward;
- selective with an integer k: every k-th block is checkpointed in full, the others keep everything;
- selective 'op': every block keeps the outputs of its expensive ops (matmuls, attention, the TP
  reduce-scatter) and reruns only the cheap elementwise ones (norms, RoPE, SiLU, residual adds).

Works on any model that keeps its blocks in `model.layers` (an nn.ModuleDict keyed by block index).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan.runtime.torch_compat import ops as torch_compat_ops
from torchtitan.runtime.torch_compat.composable import checkpoint_wrapper
from torchtitan.runtime.torch_compat.op_names import ATTENTION_KERNEL_NAMES

logger = logging.getLogger(__name__)


# Ops whose outputs op-level AC keeps: rerunning them would cost real FLOPs (matmuls, attention) or a
# second collective in backward (the TP reduce-scatter). aten.linear normally decomposes into mm /
# addmm before dispatch; it is listed for tensor types that see it whole.
_SAVE_LIST: frozenset = frozenset(
    torch_compat_ops.default_overloads(torch.ops.aten, ("mm", "addmm", "bmm", "linear", *ATTENTION_KERNEL_NAMES))
    | torch_compat_ops.tp_reduce_scatter_ops()
    # FlexAttention (document masking on CUDA) is a higher-order op: the policy sees the op itself.
    | {torch_compat_ops.flex_attention_op()}
)


def _save_expensive_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # A pure function of the op: no counters, so forward and recompute always agree on what was saved.
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_LIST else CheckpointPolicy.PREFER_RECOMPUTE


# A partial, not a pair of contexts: checkpoint calls it once per forward, and every call needs its
# own cache of saved outputs.
_op_sac_context_fn = functools.partial(create_selective_checkpoint_contexts, _save_expensive_ops)


def apply_ac(model: nn.Module, mode: str, selective_ac_option: str) -> None:
    """Wraps transformer blocks so their activations are recomputed in backward.

    full: every block. selective with integer k: every k-th block (block index % k == 0),
    trading compute for memory in between the two extremes. The choice depends only on the
    block's own index, so it needs no counter and is the same whatever the pipeline split.
    selective 'op': every block, keeping the outputs of the ops in `_SAVE_LIST` and recomputing
    the rest. All variants are non-reentrant: op-level needs it for its `context_fn`.
    """
    if mode == "selective" and selective_ac_option == "op":
        for name, block in list(model.layers.named_children()):
            model.layers.register_module(
                name, checkpoint_wrapper(block, context_fn=_op_sac_context_fn, preserve_rng_state=False)
            )
        n = len(model.layers)
        logger.info(f"applied selective (op-level) activation checkpointing to {n} of {n} blocks")
        return
    every = 1 if mode == "full" else int(selective_ac_option)
    wrapped = 0
    for name, block in list(model.layers.named_children()):
        if int(name) % every == 0:
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
            wrapped += 1
    logger.info(f"applied {mode} activation checkpointing to {wrapped} of {len(model.layers)} blocks")
