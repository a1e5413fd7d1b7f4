"""Multi-token prediction under context parallelism: the labels ahead of each position a cp rank
holds, from its own two load-balanced chunks and the heads of every rank's chunks (what the
all-gather of `context_parallel.labels_ahead_over_cp` brings), equal what one process computes for
the whole sequence, cut as `shard_sequence` cuts it. Pure index logic: no process group; the
collective and the loss are the parity row's (`dsv3_cp2`, tests/integration/test_parity.py)."""

import itertools

import pytest
import torch

from torchtitan.models.deepseek_v3.model import labels_ahead
from torchtitan.parallelisms.context_parallel import chunk_heads, labels_ahead_in_chunks
from torchtitan.parallelisms.ring_attention import shard_sequence


@pytest.mark.parametrize("cp,chunk", [(1, 3), (2, 1), (2, 4), (3, 2), (4, 2)])
def test_each_rank_gets_one_process_labels_ahead(cp, chunk):
    """Depths below, at and above the chunk length (then the labels ahead span whole chunks and
    more than one other rank), with ignored labels among them; the last positions of the whole
    sequence (the end of rank 0's second chunk) get IGNORE past the end."""
    generator = torch.Generator().manual_seed(cp * 10 + chunk)
    full = torch.randint(0, 50, (3, 2 * cp * chunk), generator=generator)
    full[0, ::3] = -100
    for depth in sorted({1, 2, chunk, chunk + 1, 2 * chunk + 1}):
        expected = labels_ahead(full, depth)
        parts = [shard_sequence(full, rank, cp) for rank in range(cp)]
        heads = torch.stack([chunk_heads(part, depth) for part in parts])  # the all-gather, in rank order
        for rank, part in enumerate(parts):
            got = labels_ahead_in_chunks(part, heads, rank, depth)
            assert torch.equal(got, shard_sequence(expected, rank, cp, dim=2)), (depth, rank)


def test_the_sequence_end_lies_on_rank_0_and_its_late_chunk_is_continued_by_rank_1():
    """cp 2, 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2. Depth 1: rank 0's
    first chunk is continued by rank 1's first label, its second chunk ends the sequence."""
    full = torch.arange(8).view(1, 8)
    parts = [shard_sequence(full, rank, 2) for rank in range(2)]
    assert parts[0].tolist() == [[0, 1, 6, 7]] and parts[1].tolist() == [[2, 3, 4, 5]]
    heads = torch.stack([chunk_heads(part, 1) for part in parts])
    assert labels_ahead_in_chunks(parts[0], heads, 0, 1)[1].tolist() == [[1, 2, 7, -100]]
    assert labels_ahead_in_chunks(parts[1], heads, 1, 1)[1].tolist() == [[3, 4, 5, 6]]


def test_a_rank_sends_only_the_heads_of_its_chunks():
    labels = torch.arange(12).view(1, 12)  # two chunks of 6
    assert chunk_heads(labels, 2).tolist() == [[[0, 1], [6, 7]]]
    assert chunk_heads(labels, 9).shape == (1, 2, 6)  # at most whole chunks
    assert list(itertools.chain(*chunk_heads(labels, 9)[0].tolist())) == list(range(12))
