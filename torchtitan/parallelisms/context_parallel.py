"""Context parallelism: each cp rank holds a load-balanced slice of every sequence.

Four things change under cp > 1, all from outside the model:
- the batch: inputs and labels are cut along the sequence (`shard_batch`); every cp rank of a
  data-parallel group reads the same batch first, as tp peers do;
- RoPE: each block receives the rows of the RoPE table for the positions its rank holds, so the
  rotation is that of the original sequence (a forward pre-hook on every attention module);
- attention: each attention module's kernel becomes ring or all-gather attention over the cp group
  (cp_attention.py, `experimental.context_parallel_method`);
- document masking: the model's mask seam (`attention_mask`) hands every block the host copy of
  the whole sequence's document ids (`host_document_ids`) instead of a mask of the local rows;
  the kernel plans its blocks from it and skips those its documents mask entirely.

The loss is each rank's mean over its own tokens (every rank holds the same number), so the mean
over the dp_cp mesh is the global mean; FSDP averages gradients over `dp_shard_cp`, which
includes cp, so the gradients are those of the global mean too.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.errors import ConfigError
from torchtitan.parallelisms.cp_attention import cp_attention, register_group
from torchtitan.parallelisms.ring_attention import shard_sequence

logger = logging.getLogger(__name__)


def shard_batch(tensors: tuple[torch.Tensor, ...], cp_mesh: DeviceMesh | None) -> tuple[torch.Tensor, ...]:
    """This cp rank's load-balanced part of (batch, seq) tensors; unchanged without cp."""
    if cp_mesh is None:
        return tensors
    rank, cp = cp_mesh.get_local_rank(), cp_mesh.size()
    return tuple(shard_sequence(t, rank, cp, dim=1) for t in tensors)


def _rope_rows_for_rank(module: nn.Module, args: tuple, *, rank: int, cp: int, seq_len: int) -> tuple:
    """Forward pre-hook of an attention module: replaces its RoPE table (the second argument) by
    the rows of this rank's positions. Attention then takes the first local-length rows."""
    x, rope, *rest = args
    return (x, shard_sequence(rope[:seq_len], rank, cp, dim=0), *rest)


def host_document_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """The models' mask seam under CP: the document ids themselves (the trainer keeps them on the
    host under CP), which every block's CP kernel takes as its `documents`."""
    return document_ids


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, seq_len: int, method: str = "ring") -> None:
    """CP attention (`method`: ring or allgather) and rank-local RoPE rows for every transformer
    block of `model` (a whole model or a pipeline stage), and the host document ids as its blocks'
    mask. Blocks keep their parameters and names."""
    for name, block in model.layers.items():
        if not hasattr(getattr(block, "attention", None), "kernel"):
            # Ring attention replaces a causal (q, k, v) kernel; other attention cannot be split this way.
            raise ConfigError(f"context parallelism needs each block's attention to expose a causal `kernel` "
                              f"(q, k, v) -> out to replace with ring attention; block layers.{name} has none")
    rank, cp = cp_mesh.get_local_rank(), cp_mesh.size()
    group_name = register_group(cp_mesh.get_group())
    for block in model.layers.values():
        block.attention.kernel = functools.partial(cp_attention, group_name=group_name, method=method)
        block.attention.register_forward_pre_hook(
            functools.partial(_rope_rows_for_rank, rank=rank, cp=cp, seq_len=seq_len))
    if hasattr(model, "attention_mask"):
        model.attention_mask = host_document_ids
    logger.info(f"applied context parallelism over mesh {{'cp': {cp}}} ({method} attention, load-balanced "
                f"{2 * cp} chunks of {seq_len // (2 * cp)} tokens, this rank holds chunks {rank} and {2 * cp - 1 - rank})")
