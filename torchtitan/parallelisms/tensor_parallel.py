"""Tensor-parallel pieces every decoder family shares: the plan of the model's root (embedding,
final norm, output projection), the padded-vocabulary mask for sharded logits, async TP, and
per-block compilation. The block's plan is decoder_tp_plan.py's, which each family extends.

The root plan assumes the decoder layout both families use: `tok_embeddings`, `layers`, `norm`,
`output` and an optional `vocab_mask` (any of them None on a pipeline stage that lacks it).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from torchtitan.errors import ConfigError
from torchtitan.parallelisms.activation_checkpoint import BlockSlot, apply_ac
from torchtitan.parallelisms.activation_offload import apply_offload
from torchtitan.parallelisms.chunked_loss import ChunkedLossHead, apply_head_tp
from torchtitan.runtime.torch_compat import compile as torch_compat_compile
from torchtitan.runtime.torch_compat import dtensor_masks as torch_compat_dtensor_masks

logger = logging.getLogger(__name__)


def check_tp_shapes(tp: int, flavor: str, sizes: tuple[tuple[str, int], ...], vocab: int) -> None:
    """The sizes tensor parallelism splits (`sizes`: (what, value) pairs such as heads and the
    feed-forward width) and the vocabulary must divide by tp; one line naming the first that does not."""
    for what, value in sizes:
        if value % tp:
            raise ConfigError(f"training.tensor_parallel_degree {tp} must divide the {what} ({value}) of {flavor}")
    if vocab % tp:
        raise ConfigError(f"training.tensor_parallel_degree {tp} must divide the vocabulary ({vocab} tokens); set "
                          f"model.vocab_size_divisible_by to {tp} (or a multiple of it) to pad it")


def apply_root_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool) -> None:
    """The embedding is split by vocabulary rows (its output is sequence-sharded under sequence
    parallelism); the output projection by vocabulary columns, and with loss parallelism its
    logits stay sharded into the cross-entropy."""
    seq = Shard(1) if sequence_parallel else Replicate()
    torch_compat_dtensor_masks.mask_without_host_reads()  # the embedding's and the loss's vocabulary masks
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    if sequence_parallel:
        root_plan["norm"] = SequenceParallel()
    if isinstance(getattr(model, "output", None), ChunkedLossHead):  # training.loss_chunk_size: its own layout
        del root_plan["output"]
        apply_head_tp(model.output, tp_mesh, loss_parallel, sequence_parallel, ShardedVocabMask)
    parallelize_module(model, tp_mesh, {k: v for k, v in root_plan.items() if getattr(model, k, None) is not None})
    if loss_parallel and getattr(model, "vocab_mask", None) is not None:
        model.vocab_mask = ShardedVocabMask(model.vocab_mask.vocab_size)


class ShardedVocabMask(nn.Module):
    """The model's padded-vocabulary mask for vocabulary-sharded logits (loss parallelism): each
    rank masks the padding ids that fall into its own slice of the columns."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, logits: DTensor) -> DTensor:
        local = logits.to_local()
        first = logits.device_mesh.get_local_rank() * local.shape[-1]  # the vocabulary divides by TP
        ids = torch.arange(first, first + local.shape[-1], device=local.device)
        masked = local.masked_fill(ids >= self.vocab_size, float("-inf"))
        return DTensor.from_local(masked, logits.device_mesh, logits.placements, shape=logits.shape, stride=logits.stride())


def apply_async_tp(tp_mesh: DeviceMesh) -> None:
    """Async TP: inductor splits each TP all-gather / reduce-scatter and its matmul into chunks that
    overlap, exchanging data through symmetric memory (CUDA only; needs training.compile)."""
    torch_compat_compile.enable_micro_pipelined_tp(tp_mesh.get_group().group_name)
    logger.info("enabled async tensor parallelism (micro-pipelined collectives)")


def bypass_autograd_cache_for_collectives() -> None:
    """Compiled TP code holds collectives that name their process group (`'7'`). PyTorch 2.13's
    AOTAutograd cache reuses such a graph from an earlier run whose layout numbered its groups
    differently, and the run then fails with "Could not resolve the process group registered under
    the name 7" (seen with FSDP 2 x TP 2 after a TP 2 x PP 2 run on the same machine). The cache is
    bypassed for TP runs; inductor's own FX graph cache stays on."""
    torch_compat_compile.disable_autograd_cache()


def apply_compile(model: nn.Module, fullgraph: bool = True) -> None:
    """Compiles each transformer block on its own (in place, so parameter names do not change).

    Blocks share one code object, so the compiled graph is reused by every block; compiling
    block by block keeps graphs small and lets FSDP / DDP hooks sit between them. `fullgraph`
    False lets data-dependent code (MoE routing) break the graph instead of failing.
    """
    for block in model.layers.values():
        block.compile(fullgraph=fullgraph)
    logger.info(f"compiled {len(model.layers)} transformer blocks with torch.compile")


def apply_ac_and_compile(model: nn.Module, tp_enabled: bool, ac_mode: str, selective_ac_option: str, compile: bool,
                         compile_fn: Callable[[nn.Module], None] = apply_compile, offload: str = "none",
                         more_blocks: Sequence[BlockSlot] = ()) -> None:
    """Activation checkpointing, torch.compile and activation offload of the blocks, in the order TP allows.

    PyTorch 2.13 cannot compile a block-level checkpoint around DTensor (TP) code: AOT autograd tries
    to save the DTensor's mesh for backward. Under TP such blocks are compiled first and checkpointed
    around the compiled code (op-level AC keeps its policy inside the graph and compiles as usual).
    `compile_fn` compiles the model's blocks (or parts of them). Offload (`offload`: none, all or
    every k-th block) wraps last, outside both: its hooks then see what the compiled or
    checkpointed block saves, and stay out of the compiled graph. `more_blocks`: blocks outside
    `model.layers` that checkpointing treats as the others (activation_checkpoint.apply_ac);
    `compile_fn` compiles them too, and offload does not reach them."""
    op_level = ac_mode == "selective" and selective_ac_option == "op"
    checkpoint_compiled = compile and tp_enabled and not op_level
    if ac_mode != "none" and not checkpoint_compiled:
        apply_ac(model, ac_mode, selective_ac_option, more_blocks)
    if compile:
        if tp_enabled:
            bypass_autograd_cache_for_collectives()
        compile_fn(model)
        if tp_enabled and model.tok_embeddings is not None:
            # PyTorch 2.13: when a compiled block's input is the view that DTensor.to_local() returned
            # (the embedding's output), its input gradient skips the to_local's backward, and the
            # embedding's redistribute then receives a plain tensor. A copy breaks the alias.
            model.tok_embeddings.register_forward_hook(lambda module, args, output: output.clone())
    if ac_mode != "none" and checkpoint_compiled:
        apply_ac(model, ac_mode, selective_ac_option, more_blocks)
    if offload != "none":
        apply_offload(model, offload)

