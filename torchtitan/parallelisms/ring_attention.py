"""Ring attention for context parallelism: causal attention over a sequence split across cp ranks.

Load balancing. The sequence is cut into 2 x cp chunks, and rank i holds chunks i and 2cp-1-i
(`shard_sequence`). Under a causal mask, chunk c attends to chunks 0..c, so an early chunk paired
with a late one gives every rank the same amount of work.

Forward. Each rank keeps its queries. Key/value blocks travel around the ring: at step s, rank r
holds the block of rank (r - s) mod cp, and sends it on to r + 1 while it computes. What rank r's
two query chunks (i, 2cp-1-i) need from the block of rank j (chunks j, 2cp-1-j):
  j == i: both chunks, causal on the diagonal (q_i x k_i, q_late x k_late) and full q_late x k_i;
  j <  i: only the block's early chunk j, for both query chunks (the late chunk is in the future);
  j >  i: only the late query chunk, against the whole block.
Partial results are merged with their log-sum-exp (online softmax), so the output is exact.

Backward. A custom autograd function recomputes each block's gradients from the final output
and log-sum-exp (the flash-attention identity), accumulating dq locally. The next key/value block
is sent before each step's compute; the block's dk/dv accumulators follow it one exchange behind
(they can leave only once this rank has added to them) and arrive back at the owner after cp hops.

Blocks: which (query rows x key columns) each step computes is `cp_block_plan.plan_blocks`; with
document masking it skips every block whose keys lie in earlier documents than its queries. The
block kernels (attention_blocks.py) are PyTorch's fused attention ops, so no (Sq x Sk) score matrix
is ever stored and memory stays linear in the local sequence. Grouped-query attention is handled by
sending the smaller key/value heads around and expanding them per block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchtitan.parallelisms.cp_block_plan import (
    Block,
    DocumentPlan,
    Span,
    backward_blocks,
    forward_blocks,
    merge_full_blocks,
    plan_blocks,
)


def load_balanced_chunks(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two sequence chunks (of 2 x cp) that a cp rank holds."""
    return cp_rank, 2 * cp - 1 - cp_rank


def shard_sequence(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's load-balanced part of a full-sequence tensor (inputs, labels, positions)."""
    if x.shape[dim] % (2 * cp):
        raise ValueError(f"sequence length {x.shape[dim]} must divide by 2 x cp = {2 * cp}")
    chunks = x.chunk(2 * cp, dim=dim)
    first, second = load_balanced_chunks(cp_rank, cp)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of shard_sequence, given every cp rank's part in rank order (all-gather attention, tests)."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        a, b = part.chunk(2, dim=dim)
        first, second = load_balanced_chunks(rank, cp)
        chunks[first], chunks[second] = a, b
    return torch.cat(chunks, dim=dim)


def chunk_spans(rank: int, cp: int, chunk: int) -> list[Span]:
    """The global positions of a rank's two chunks and where they sit in its local tensors."""
    first, second = load_balanced_chunks(rank, cp)
    return [Span(first * chunk, chunk, 0), Span(second * chunk, chunk, chunk)]


def ring_step_blocks(rank: int, src: int, cp: int, chunk: int, documents: DocumentPlan | None,
                     tile: int, window: int | None = None) -> list[Block]:
    """The blocks rank `rank` computes against the key/value block of rank `src` (none, with a
    window, when every key of the block is out of every query's band: the ring still passes it on)."""
    blocks = []
    for queries in chunk_spans(rank, cp, chunk):
        for keys in chunk_spans(src, cp, chunk):
            blocks += plan_blocks(queries, keys, documents, tile, window)
    return merge_full_blocks(blocks)


class _Ring:
    """Sends a list of tensors to the next cp rank and receives the same shapes from the previous."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensors: list[torch.Tensor]):
        received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return dist.batch_isend_irecv(ops), received

    @staticmethod
    def finish(handle) -> list[torch.Tensor]:
        works, received = handle
        for work in works:
            work.wait()
        return received


def ring_forward(q, k, v, group, scale: float, kernel: str, ids: torch.Tensor | None,
                 documents: DocumentPlan | None, tile: int, window: int | None = None):
    """Out (fp32) and lse of this rank's queries over the whole sequence; `ids` (batch, seq): the
    device's document ids with `documents` their plan, or both None for plain causal attention."""
    ring = _Ring(group)
    rank, cp = ring.rank, ring.size
    c = q.shape[2] // 2
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    kv = [k, v]
    for step in range(cp):
        src = (rank - step) % cp
        pending = ring.start(kv) if step < cp - 1 else None  # the next block travels during compute
        forward_blocks(q, kv[0], kv[1], ring_step_blocks(rank, src, cp, c, documents, tile, window), out, lse,
                       scale, kernel, ids)
        if pending is not None:
            kv = _Ring.finish(pending)
    return out, lse


def ring_backward(dout, q, k, v, out, lse, group, scale: float, kernel: str, ids: torch.Tensor | None,
                  documents: DocumentPlan | None, tile: int, window: int | None = None):
    ring = _Ring(group)
    rank, cp = ring.rank, ring.size
    c = q.shape[2] // 2
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = [k, v]
    # This rank's share of the gradients of the key/value block at hand: they travel with it, one
    # step behind (a block's accumulators can leave only once this rank added to them).
    grads = [torch.zeros(k.shape, dtype=torch.float32, device=k.device),
             torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
    for step in range(cp):
        src = (rank - step) % cp
        # The next block travels while this one's gradients are computed.
        pending = ring.start(kv) if step < cp - 1 else None
        # The accumulators gain this rank's share in place: they are this rank's own tensors
        # (fresh zeros, or buffers just received).
        backward_blocks(dout, q, kv[0], kv[1], out, lse, ring_step_blocks(rank, src, cp, c, documents, tile, window),
                        dq, grads[0], grads[1], scale, kernel, ids)
        if cp > 1:
            # After the last step one more hop brings each accumulator home: its owner is next.
            grads = _Ring.finish(ring.start(grads))
        if pending is not None:
            kv = _Ring.finish(pending)
    return dq, grads[0], grads[1]
