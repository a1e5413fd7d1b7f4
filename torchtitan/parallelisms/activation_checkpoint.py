"""Activation checkpointing of transformer blocks: recompute activations in backward to save memory.

Three granularities, from most memory saved to least compute repeated:
- full: every block keeps only its input; all of its forward is rerun in backward;
- selective with an integer k: every k-th block is checkpointed in full, the others keep everything;
- selective 'op': every block keeps the outputs of its expensive ops (matmuls, attention, the TP
  reduce-scatter) and reruns only the cheap elementwise ones (norms, RoPE, SiLU, residual adds).

Works on any model that keeps its blocks in `model.layers` (an nn.ModuleDict keyed by block index);
blocks kept elsewhere (DeepSeek-V3's multi-token prediction modules) are named by the caller as
`BlockSlot`s, with the index the selective option counts them by.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan.parallelisms.lora_linear import is_adapted
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


# The matmuls among them, and where each finds its contraction dim: the first matrix's last dim
# (addmm's first argument is the added tensor).
_MATMULS = {op: 1 if op in torch_compat_ops.default_overloads(torch.ops.aten, ("addmm",)) else 0
            for op in torch_compat_ops.default_overloads(torch.ops.aten, ("mm", "addmm", "bmm", "linear"))}


def _save_expensive_ops(ctx, op, *args, low_rank: frozenset = frozenset(), **kwargs) -> CheckpointPolicy:
    """Keep the outputs of `_SAVE_LIST` ops, but for matmuls contracting over a LoRA rank
    (`low_rank`): a LoRA adapter's up-projection has the base's output size but costs rank / in of
    its FLOPs, so keeping it would double the block's kept matmul outputs for a sliver of compute
    (Llama 3 8B, rank 16, FSDP 8: 21 GiB more per rank). A base matmul whose contraction dim equals
    a LoRA rank is recomputed too: the same values, a little more compute."""
    # A pure function of the op and its shapes: forward and recompute always agree on what was saved.
    if op not in _SAVE_LIST:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if low_rank and op in _MATMULS and args[_MATMULS[op]].shape[-1] in low_rank:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _op_sac_context_fn(low_rank: frozenset) -> functools.partial:
    # A partial, not a pair of contexts: checkpoint calls it once per forward, and every call needs
    # its own cache of saved outputs.
    return functools.partial(create_selective_checkpoint_contexts,
                             functools.partial(_save_expensive_ops, low_rank=low_rank))


class BlockSlot(NamedTuple):
    """Where a block sits (`parent`'s child `name`) and its index (the block's layer id)."""

    parent: nn.Module
    name: str
    index: int


def block_slots(model: nn.Module, more: Sequence[BlockSlot] = ()) -> list[BlockSlot]:
    """The blocks of `model.layers` (indexed by their keys), then `more`."""
    return [*(BlockSlot(model.layers, name, int(name)) for name in model.layers.keys()), *more]


def apply_ac(model: nn.Module, mode: str, selective_ac_option: str, more_blocks: Sequence[BlockSlot] = ()) -> None:
    """Wraps transformer blocks (those of `model.layers`, then `more_blocks`) so their activations
    are recomputed in backward.

    full: every block. selective with integer k: every k-th block (block index % k == 0),
    trading compute for memory in between the two extremes. The choice depends only on the
    block's own index, so it needs no counter and is the same whatever the pipeline split.
    selective 'op': every block, keeping the outputs of the ops in `_SAVE_LIST` and recomputing
    the rest. All variants are non-reentrant: op-level needs it for its `context_fn`.
    """
    slots = block_slots(model, more_blocks)
    if mode == "selective" and selective_ac_option == "op":
        context_fn = _op_sac_context_fn(frozenset(m.lora_a.weight.shape[0] for m in model.modules() if is_adapted(m)))
        for parent, name, _ in slots:
            parent.register_module(name, checkpoint_wrapper(getattr(parent, name), context_fn=context_fn,
                                                            preserve_rng_state=False))
        logger.info(f"applied selective (op-level) activation checkpointing to {len(slots)} of {len(slots)} blocks")
        return
    every = 1 if mode == "full" else int(selective_ac_option)
    wrapped = 0
    for parent, name, index in slots:
        if index % every == 0:
            parent.register_module(name, checkpoint_wrapper(getattr(parent, name), preserve_rng_state=False))
            wrapped += 1
    logger.info(f"applied {mode} activation checkpointing to {wrapped} of {len(slots)} blocks")
