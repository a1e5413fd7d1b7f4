"""Which blocks of (query rows x key columns) a context-parallel rank computes, and how.

Both CP methods (ring_attention.py, allgather_attention.py) compute a rank's queries against
contiguous ranges of the sequence's keys. A `Block` is one kernel call: query rows and key
columns (local indices into the tensors at hand), and whether it is full, causal (a square
diagonal block) or masked by documents.

Plain causal attention: a query chunk meets a key range before it in full, and itself causally.

Document masking (training.document_mask): a packed sequence holds several documents and a query
attends only to earlier keys of its own document. Document ids grow along the sequence, so the
keys a run of queries [qs, qe) may need are one contiguous range, [first position of qs's document,
qe): everything before it is masked for every query of the run and is never computed. The query
chunk is cut into tiles of `tile` rows, each tile computes only that range, and within it a block
needs a mask only where the range crosses a document boundary. Tiles that need the same keys in
full are merged into one block. Masks are built on the device from the document ids of the rows
and columns (`document_mask`), the plan itself from a host copy of the ids, so planning never
waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtitan.observability import host_reads
from torchtitan.parallelisms.attention_blocks import (
    block_backward,
    block_forward,
    document_mask,
    expand_heads,
    merge,
    reduce_head_groups,
)

# Query rows per tile under document masking: small enough that a tile rarely spans many
# documents' keys, large enough that each kernel call still runs at speed.
DEFAULT_TILE = 512


@dataclass(frozen=True)
class Block:
    rows: slice  # local query rows
    cols: slice  # local key columns
    causal: bool  # a square diagonal block, upper triangle masked
    # Document masking or a window: the global positions of the first row and column (the mask is
    # built from the ids there and from the positions); None for a block that needs no mask.
    masked_at: tuple[int, int] | None = None
    window: int | None = None  # banded attention: key j seen by query i iff i - window < j <= i


@dataclass(frozen=True)
class Span:
    """A contiguous range of global positions held at local index `local` of a tensor."""

    start: int
    length: int
    local: int

    @property
    def end(self) -> int:
        return self.start + self.length


def document_starts(ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq) first position of each position's document (ids grow along the sequence)."""
    positions = torch.arange(ids.shape[1], dtype=torch.int64).expand(ids.shape)
    changed = torch.ones(ids.shape, dtype=torch.bool)
    changed[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return torch.where(changed, positions, torch.zeros_like(positions)).cummax(dim=1).values


class DocumentPlan:
    """Per-position facts a plan needs, read once from the host copy of the document ids (batch,
    seq): for each position, the earliest start over the batch of its document (where a tile's
    keys begin) and the latest (whether a range is one document in every row)."""

    def __init__(self, ids_host: torch.Tensor):
        # The ids are the batch's own, computed on the host from the inputs before they went to the
        # device: reading them waits for nothing.
        with host_reads.deferred_read():
            starts = document_starts(ids_host.to("cpu", torch.int64))
            self.earliest = starts.amin(dim=0).tolist()
            self.latest = starts.amax(dim=0).tolist()


def plan_blocks(queries: Span, keys: Span, documents: DocumentPlan | None, tile: int = DEFAULT_TILE,
                window: int | None = None) -> list[Block]:
    """The blocks that compute `queries` against `keys`, causally (keys after a query are never
    attended), within `window` positions of each query when banded (gpt-oss's sliding-window
    blocks): keys wholly outside the band are never computed, as keys of earlier documents.
    Ranges are whole CP chunks: the key range either ends at or before the queries start, or
    contains them exactly (the diagonal)."""
    if keys.start >= queries.end:
        return []
    diagonal = keys.end > queries.start
    if diagonal and not (keys.start <= queries.start and keys.end == queries.end):
        raise ValueError(f"keys {keys} must end before queries {queries} or end with them")
    if documents is None and window is None:
        return _tile_blocks(queries, keys, None, None)
    # One block per part when the whole chunk is one document in every row and inside the band,
    # else tiles; a band's tiles are at most a window tall, so each meets about two windows of keys.
    whole = _tile_blocks(queries, keys, documents, window)
    if all(block.masked_at is None for block in whole) and len(whole) <= 1 + diagonal:
        return whole
    rows = tile if window is None else max(1, min(tile, window))
    blocks: list[Block] = []
    for start in range(queries.start, queries.end, rows):
        part = Span(start, min(rows, queries.end - start), queries.local + start - queries.start)
        blocks += _tile_blocks(part, keys, documents, window)
    return merge_full_blocks(blocks)


def _tile_blocks(queries: Span, keys: Span, documents: DocumentPlan | None, window: int | None) -> list[Block]:
    """The blocks of one run of queries: the keys before them, then the diagonal square."""
    qs, qe = queries.start, queries.end
    lo = keys.start if documents is None else max(keys.start, documents.earliest[qs])
    if window is not None:
        lo = max(lo, qs - window + 1)  # the first query's band starts there; later queries' later
    hi = min(keys.end, qe)
    if lo >= hi:
        return []  # every key of the range is in an earlier document, or out of the band, for every query

    def rows() -> slice:
        return slice(queries.local, queries.local + queries.length)

    def cols(a: int, b: int) -> slice:
        return slice(keys.local + a - keys.start, keys.local + b - keys.start)

    def banded(first_key: int) -> bool:
        """Whether the band cuts the block: its last query is a window or more past its first key."""
        return window is not None and qe - 1 - first_key >= window

    blocks = []
    past_end = min(hi, qs)
    if lo < past_end:
        # One document throughout iff the last query's document began at or before lo in every row.
        masked = (documents is not None and documents.latest[qe - 1] > lo) or banded(lo)
        blocks.append(Block(rows(), cols(lo, past_end), False, (qs, lo) if masked else None, window if masked else None))
    if hi > qs:  # the diagonal square [qs, qe)
        masked = (documents is not None and documents.latest[qe - 1] > qs) or banded(qs)
        blocks.append(Block(rows(), cols(qs, qe), not masked, (qs, qs) if masked else None, window if masked else None))
    return blocks


def merge_full_blocks(blocks: list[Block]) -> list[Block]:
    """Adjacent full blocks of the same columns (or the same rows) become one block: fewer, larger
    kernel calls. Plain causal attention then makes one call per chunk pair."""
    merged: list[Block] = []
    for block in blocks:
        last = merged[-1] if merged else None
        full = last is not None and not (block.causal or last.causal or block.masked_at or last.masked_at)
        if full and last.cols == block.cols and last.rows.stop == block.rows.start:
            merged[-1] = Block(slice(last.rows.start, block.rows.stop), block.cols, False)
        elif full and last.rows == block.rows and last.cols.stop == block.cols.start:
            merged[-1] = Block(block.rows, slice(last.cols.start, block.cols.stop), False)
        else:
            merged.append(block)
    return merged


def forward_blocks(q, k, v, blocks: list[Block], out, lse, scale: float, kernel: str, ids: torch.Tensor | None) -> None:
    """Folds each block's attention of q's rows over k/v's columns into the running out and lse
    (fp32), in place. k/v may have fewer heads than q (grouped-query attention): each block's
    columns are expanded to q's heads, never the whole range at once."""
    groups = q.shape[1] // k.shape[1]
    for block in blocks:
        mask = block_mask(block, ids, q.device)
        bk, bv = expand_heads(k[:, :, block.cols], groups), expand_heads(v[:, :, block.cols], groups)
        o, s = block_forward(q[:, :, block.rows], bk, bv, block.causal, scale, kernel, mask)
        merge(out, lse, o, s, block.rows, masked=mask is not None)


def backward_blocks(dout, q, k, v, out, lse, blocks: list[Block], dq, dk, dv, scale: float, kernel: str,
                    ids: torch.Tensor | None) -> None:
    """Adds each block's gradients to dq (q's rows) and dk, dv (k/v's columns, k/v's heads), given
    the final out and lse of the rows."""
    groups = q.shape[1] // k.shape[1]
    for block in blocks:
        rows, cols = block.rows, block.cols
        bk, bv = expand_heads(k[:, :, cols], groups), expand_heads(v[:, :, cols], groups)
        gq, gk, gv = block_backward(dout[:, :, rows], q[:, :, rows], bk, bv, out[:, :, rows],
                                    lse[:, :, rows].contiguous(), block.causal, scale, kernel,
                                    block_mask(block, ids, q.device))
        dq[:, :, rows] += gq
        dk[:, :, cols] += reduce_head_groups(gk, groups)
        dv[:, :, cols] += reduce_head_groups(gv, groups)


def block_mask(block: Block, ids: torch.Tensor | None, device: torch.device | None = None) -> torch.Tensor | None:
    """The additive mask (batch, 1, rows, cols) of a masked block, from the device's document ids
    (batch, seq) of the whole sequence (None without document masking) and the block's window;
    None for an unmasked block."""
    if block.masked_at is None:
        return None
    q0, k0 = block.masked_at
    rows, cols = block.rows.stop - block.rows.start, block.cols.stop - block.cols.start
    if ids is None:
        mask = torch.zeros(1, 1, rows, cols, device=device)
        if q0 == k0:
            mask = mask.masked_fill(torch.ones(rows, cols, dtype=torch.bool, device=device).triu(1), float("-inf"))
    else:
        mask = document_mask(ids[:, q0:q0 + rows], ids[:, k0:k0 + cols], causal=q0 == k0)
    if block.window is not None:
        q_pos = torch.arange(q0, q0 + rows, device=mask.device).unsqueeze(1)
        k_pos = torch.arange(k0, k0 + cols, device=mask.device).unsqueeze(0)
        mask = mask.masked_fill(k_pos <= q_pos - block.window, float("-inf"))
    return mask
