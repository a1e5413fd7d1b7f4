"""All-gather attention for context parallelism: every rank gathers the whole sequence's keys and
values, then attends its own load-balanced query chunks (`experimental.context_parallel_method
allgather`).

Forward. One all-gather over the cp group brings every rank's key/value chunks; put back in
sequence order, they are the whole sequence's keys and values. A rank's two query chunks (i and
2cp-1-i, as for the ring) attend keys [0, end of the chunk) causally, in the blocks that
`cp_block_plan.plan_blocks` gives (with document masking, only the keys of each tile's documents).

Backward. The keys and values are gathered again (rather than kept: a rank would otherwise hold the
whole sequence's keys and values per layer until backward), each rank computes the gradients of
the whole sequence's keys and values from its queries, and one reduce-scatter sums them and hands
each rank the rows of its own chunks.

Against the ring: the same bytes travel (cp - 1 shares of K/V in forward), but in one collective
instead of cp - 1 exchanges, and with no compute to hide it behind; in return nothing is sent per
step and the blocks are as large as they can be. With grouped-query attention K/V are small (the
Llama 3 8B's 8 K/V heads against 32 query heads), so gathering them costs little memory: the ring
pays off where K/V are large and the exchange is slow. docs/context_parallel.md has the measurements.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchtitan.parallelisms.cp_block_plan import (
    DocumentPlan,
    Span,
    backward_blocks,
    forward_blocks,
    plan_blocks,
)
from torchtitan.parallelisms.ring_attention import chunk_spans, shard_sequence, unshard_sequence

# torch 2.13 renamed the one-tensor collectives (`*_single`) and warns, once per process, on every
# rank's console, at the old names; torch 2.11 has only the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_sequence(k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
    """(2, batch, kv_heads, seq, head_dim): every rank's keys and values in sequence order."""
    cp = dist.get_world_size(group)
    local = torch.stack([k, v])
    gathered = torch.empty((cp * 2, *k.shape), dtype=k.dtype, device=k.device)
    all_gather_single(gathered, local.contiguous(), group=group)
    return unshard_sequence(list(gathered.view(cp, *local.shape).unbind(0)), dim=3)


def _query_blocks(rank: int, cp: int, chunk: int, documents: DocumentPlan | None, tile: int,
                  window: int | None = None):
    """Every block of this rank's queries: each chunk against the key chunks up to its own, one
    key chunk at a time. Blocks stay at most a chunk wide, so grouped-query attention expands (and
    its gradients come back in) one chunk of keys at a time, never the whole sequence's."""
    blocks = []
    for queries in chunk_spans(rank, cp, chunk):
        for start in range(0, queries.end, chunk):
            blocks += plan_blocks(queries, Span(start, chunk, start), documents, tile, window)
    return blocks


def allgather_forward(q, k, v, group, scale: float, kernel: str, ids: torch.Tensor | None,
                      documents: DocumentPlan | None, tile: int, window: int | None = None):
    """Out (fp32) and lse of this rank's queries over the whole sequence (as `ring_forward`)."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    keys, values = _gather_sequence(k, v, group).unbind(0)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    forward_blocks(q, keys, values, _query_blocks(rank, cp, q.shape[2] // 2, documents, tile, window), out, lse,
                   scale, kernel, ids)
    return out, lse


def allgather_backward(dout, q, k, v, out, lse, group, scale: float, kernel: str, ids: torch.Tensor | None,
                       documents: DocumentPlan | None, tile: int, window: int | None = None):
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    keys, values = _gather_sequence(k, v, group).unbind(0)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros((2, *keys.shape), dtype=torch.float32, device=k.device)
    backward_blocks(dout, q, keys, values, out, lse, _query_blocks(rank, cp, q.shape[2] // 2, documents, tile, window),
                    dq, dkv[0], dkv[1], scale, kernel, ids)
    # Every rank's chunks in rank order, then one reduce-scatter: rank r receives the sum over ranks
    # of the gradients of its own chunks.
    by_rank = torch.cat([shard_sequence(dkv, r, cp, dim=3) for r in range(cp)])
    mine = torch.empty((2, *k.shape), dtype=torch.float32, device=k.device)
    _reduce_scatter(mine, by_rank, group=group)
    return dq, mine[0], mine[1]
