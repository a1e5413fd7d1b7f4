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

Labels further ahead (`labels_ahead_over_cp`, DeepSeek-V3's multi-token prediction): the labels a
few positions after each of a rank's chunks begin the next chunk, which another rank holds (or none,
after the sequence's last chunk). Every rank sends the first `depth` labels of its two chunks to the
others in one small all-gather, and each chunk is continued by the start of the chunk after it.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.datasets.text_dataset import IGNORE_INDEX
from torchtitan.errors import ConfigError
from torchtitan.parallelisms.allgather_attention import all_gather_single
from torchtitan.parallelisms.cp_attention import cp_attention, register_group
from torchtitan.parallelisms.ring_attention import load_balanced_chunks, shard_sequence

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


def chunk_heads(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """(batch, 2, h): the first h = min(depth, chunk length) labels of each of a rank's two chunks
    (labels: (batch, 2 x chunk length), as `shard_sequence` cut them)."""
    chunks = labels.unflatten(1, (2, -1))
    return chunks[..., :min(depth, chunks.shape[-1])].contiguous()


def labels_ahead_in_chunks(labels: torch.Tensor, heads: torch.Tensor, rank: int, depth: int) -> torch.Tensor:
    """What `labels_ahead` gives one process, for the positions cp rank `rank` holds: (depth + 1,
    batch, local seq), [k] the label k positions after each of them in the whole sequence,
    IGNORE_INDEX past its end. `heads` (cp, batch, 2, h): every rank's `chunk_heads`, in rank order.
    A pure function of its inputs: the index logic, testable without a process group."""
    cp, batch, _, h = heads.shape
    length = labels.shape[1] // 2
    held_at = {chunk: 2 * r + slot for r in range(cp) for slot, chunk in enumerate(load_balanced_chunks(r, cp))}
    # The heads in sequence order: (batch, 2cp, h).
    by_chunk = heads.transpose(0, 1).reshape(batch, 2 * cp, h)[:, [held_at[c] for c in range(2 * cp)]]
    continued = []
    for slot, chunk in enumerate(load_balanced_chunks(rank, cp)):
        # The labels after the chunk: the next chunk's head (whole chunks when depth exceeds their
        # length, h then being a whole chunk), and nothing after the last chunk.
        after = by_chunk[:, chunk + 1:].reshape(batch, -1)[:, :depth]
        after = F.pad(after, (0, depth - after.shape[1]), value=IGNORE_INDEX)
        continued.append(torch.cat([labels[:, slot * length:(slot + 1) * length], after], dim=1))
    return torch.stack([torch.cat([c[:, k:k + length] for c in continued], dim=1) for k in range(depth + 1)])


def labels_ahead_over_cp(cp_mesh: DeviceMesh) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """The model's `labels_ahead` seam under context parallelism: the heads of every rank's chunks
    gathered over `cp_mesh` (2 x depth labels per sequence and rank; integers, no gradient), then
    `labels_ahead_in_chunks`."""
    rank, cp, group = cp_mesh.get_local_rank(), cp_mesh.size(), cp_mesh.get_group()

    def labels_ahead(labels: torch.Tensor, depth: int) -> torch.Tensor:
        heads = chunk_heads(labels, depth)
        gathered = heads.new_empty((cp * heads.shape[0], *heads.shape[1:]))  # ranks along the first dim (gloo)
        all_gather_single(gathered, heads, group=group)
        return labels_ahead_in_chunks(labels, gathered.unflatten(0, (cp, -1)), rank, depth)

    return labels_ahead


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, seq_len: int, method: str = "ring",
             blocks: Sequence[tuple[str, nn.Module]] | None = None) -> None:
    """CP attention (`method`: ring or allgather) and rank-local RoPE rows for every transformer
    block of `model` (a whole model or a pipeline stage), and the host document ids as its blocks'
    mask. Blocks keep their parameters and names. `blocks` (name, block): the blocks, where a model
    has more than `model.layers` (DeepSeek-V3's MTP modules)."""
    blocks = [(f"layers.{name}", block) for name, block in model.layers.items()] if blocks is None else blocks
    for name, block in blocks:
        if not hasattr(getattr(block, "attention", None), "kernel"):
            # Ring attention replaces a causal (q, k, v) kernel; other attention cannot be split this way.
            raise ConfigError(f"context parallelism needs each block's attention to expose a causal `kernel` "
                              f"(q, k, v) -> out to replace with ring attention; block {name} has none")
    rank, cp = cp_mesh.get_local_rank(), cp_mesh.size()
    group_name = register_group(cp_mesh.get_group())
    for _, block in blocks:
        block.attention.kernel = functools.partial(cp_attention, group_name=group_name, method=method)
        block.attention.register_forward_pre_hook(
            functools.partial(_rope_rows_for_rank, rank=rank, cp=cp, seq_len=seq_len))
    if hasattr(model, "attention_mask"):
        model.attention_mask = host_document_ids
    logger.info(f"applied context parallelism over mesh {{'cp': {cp}}} ({method} attention, load-balanced "
                f"{2 * cp} chunks of {seq_len // (2 * cp)} tokens, this rank holds chunks {rank} and {2 * cp - 1 - rank})")
