"""Context parallelism's block plans (cp_block_plan.py), without processes: for every rank and
every key/value block it meets (ring) or the whole sequence (all-gather), the planned blocks cover
each (query, key) pair a query may attend exactly once, unmasked cells only where attention is
allowed, and never a block whose keys all lie in earlier documents than its queries."""

import random

import pytest
import torch

from torchtitan.parallelisms.allgather_attention import _query_blocks
from torchtitan.parallelisms.cp_attention import _group
from torchtitan.parallelisms.cp_block_plan import DocumentPlan, Span, block_mask, document_starts, plan_blocks
from torchtitan.parallelisms.ring_attention import chunk_spans, ring_step_blocks


def _random_documents(batch: int, seq: int, seed: int, mean: float) -> torch.Tensor:
    rng = random.Random(seed)
    ids = torch.zeros(batch, seq, dtype=torch.int32)
    for row in range(batch):
        position = 0
        while True:
            position += max(1, int(rng.expovariate(1 / mean)))
            if position >= seq:
                break
            ids[row, position:] += 1
    return ids


def _coverage(cp: int, chunk: int, ids: torch.Tensor | None, tile: int, method: str, window: int | None = None):
    """Per batch row, how often each global (query, key) cell is computed unmasked, and the
    number of cells computed at all (masked or not)."""
    seq = 2 * cp * chunk
    batch = 1 if ids is None else ids.shape[0]
    counts = torch.zeros(batch, seq, seq, dtype=torch.int32)
    computed = 0
    documents = None if ids is None else DocumentPlan(ids)
    for rank in range(cp):
        # Local row -> global position, and per key/value source local column -> global position.
        rows = torch.cat([torch.arange(s.start, s.end) for s in chunk_spans(rank, cp, chunk)])
        if method == "ring":
            sources = [(ring_step_blocks(rank, src, cp, chunk, documents, tile, window),
                        torch.cat([torch.arange(s.start, s.end) for s in chunk_spans(src, cp, chunk)]))
                       for src in range(cp)]
        else:
            sources = [(_query_blocks(rank, cp, chunk, documents, tile, window), torch.arange(seq))]
        for blocks, cols in sources:
            for block in blocks:
                q, k = rows[block.rows], cols[block.cols]
                computed += len(q) * len(k)
                allowed = torch.ones(batch, len(q), len(k), dtype=torch.bool)
                if block.causal:
                    allowed &= torch.ones(len(q), len(k), dtype=torch.bool).tril()
                mask = block_mask(block, ids)
                assert (mask is None) == (block.masked_at is None)
                if mask is not None:
                    assert block.masked_at == (int(q[0]), int(k[0]))
                    allowed &= torch.isfinite(mask[:, 0])
                # Every computed cell is causal.
                assert bool((k.unsqueeze(0) <= q.unsqueeze(1))[allowed.any(0)].all())
                counts[:, q.unsqueeze(1), k.unsqueeze(0)] += allowed.int()
    return counts, computed


@pytest.mark.parametrize("method", ["ring", "allgather"])
@pytest.mark.parametrize("cp,chunk,tile,mean", [(2, 16, 4, 6.0), (4, 8, 3, 10.0), (2, 12, 512, 5.0), (4, 8, 8, 1000.0)])
def test_each_allowed_pair_is_computed_once(method, cp, chunk, tile, mean):
    seq = 2 * cp * chunk
    ids = _random_documents(2, seq, seed=cp * chunk + tile, mean=mean)
    counts, computed = _coverage(cp, chunk, ids, tile, method)
    allowed = (ids.unsqueeze(2) == ids.unsqueeze(1)) & torch.ones(seq, seq, dtype=torch.bool).tril()
    assert torch.equal(counts, allowed.int())
    if mean < 20 and tile < chunk:  # short documents, small tiles: most of the triangle is skipped, not masked
        assert computed < 0.6 * seq * (seq + 1) / 2, computed


@pytest.mark.parametrize("method", ["ring", "allgather"])
@pytest.mark.parametrize("window,with_documents", [(5, False), (1, False), (9, True), (100, False)])
def test_banded_attention_computes_each_pair_in_the_band_once(method, window, with_documents):
    """gpt-oss's sliding-window blocks: key j for query i iff i - window < j <= i, alone or beside
    documents; a band narrower than a chunk computes far fewer cells than the causal triangle."""
    cp, chunk, tile = 4, 8, 4
    seq = 2 * cp * chunk
    ids = _random_documents(2, seq, seed=window, mean=12.0) if with_documents else None
    counts, computed = _coverage(cp, chunk, ids, tile, method, window)
    positions = torch.arange(seq)
    allowed = (positions.unsqueeze(0) <= positions.unsqueeze(1)) & (positions.unsqueeze(0) > positions.unsqueeze(1) - window)
    if ids is not None:
        allowed = allowed & (ids.unsqueeze(2) == ids.unsqueeze(1))
    assert torch.equal(counts, allowed.int().expand_as(counts))
    if window < chunk:
        # Each query meets at most its tile's rows plus the window of keys: far below the triangle.
        assert computed < seq * (window + tile), computed


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_plain_causal_plans_one_block_per_chunk_pair(method):
    cp, chunk = 4, 8
    counts, computed = _coverage(cp, chunk, None, 512, method)
    seq = 2 * cp * chunk
    assert torch.equal(counts[0], torch.ones(seq, seq, dtype=torch.int32).tril())
    for rank in range(cp):
        for src in range(cp):
            blocks = ring_step_blocks(rank, src, cp, chunk, None, 512)
            # The diagonal step: two causal squares and the late chunk over the early one; else one block.
            assert len(blocks) == (3 if src == rank else 1)
            assert all(b.masked_at is None for b in blocks)


def test_one_document_needs_no_mask_and_no_tiles():
    ids = torch.zeros(1, 64, dtype=torch.int32)
    blocks = plan_blocks(Span(32, 16, 16), Span(0, 48, 0), DocumentPlan(ids), tile=4)
    assert [(b.rows, b.cols, b.causal, b.masked_at) for b in blocks] == [
        (slice(16, 32), slice(0, 32), False, None), (slice(16, 32), slice(32, 48), True, None)]


def test_keys_of_earlier_documents_are_skipped():
    ids = torch.zeros(1, 64, dtype=torch.int32)
    ids[:, 32:] = 1  # the queries' document starts with them
    assert plan_blocks(Span(32, 16, 0), Span(0, 16, 0), DocumentPlan(ids)) == []


def test_document_starts():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    assert document_starts(ids).tolist() == [[0, 0, 2, 2, 2, 5], [0, 0, 0, 0, 0, 0]]


def test_bad_ranges_and_groups_are_refused():
    with pytest.raises(ValueError, match="must end before queries"):
        plan_blocks(Span(16, 16, 0), Span(0, 48, 0), None)
    with pytest.raises(KeyError, match="was not registered for context parallelism"):
        _group("no such group")


def test_a_batch_is_planned_once_for_all_blocks():
    from torchtitan.parallelisms.cp_attention import _on_device

    ids = torch.zeros(1, 16, dtype=torch.int32)
    ids[:, 9:] = 1
    first, second = _on_device(ids, ids)[1], _on_device(ids, ids)[1]
    assert first is second  # the next block of the same forward
    other = _on_device(ids.clone(), ids)[1]
    assert other is not first and other.latest == first.latest  # a new batch is planned anew
