"""The seeded order a data shard reads its chunks and documents in (training.dataset_shuffle).

Two levels, both pure functions of the seed and the item's place, so every process (rank or
data-loading worker) computes the same order without talking to another, and a resumed run
starts at an item without reading any before it:

- the chunks of a shard: epoch e reads them in a permutation drawn from (seed, shard, e), so item
  k of the stream is chunk order_e[k mod n] of epoch e = k div n;
- the documents of a chunk: item k's documents are permuted by a draw from (seed, shard, k), so
  the same chunk is read in another order in another epoch.

The permutations are Fisher-Yates shuffles driven by `random.Random(<string seed>).random()`, the
one sequence Python promises to keep for a given seed across versions (a saved position must mean
the same order after an upgrade); `random.shuffle` and `torch.randperm` make no such promise.
Documents are not mixed across chunks: the item stays the unit of reading and of resuming.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Shuffle:
    seed: int

    def chunk_order(self, shard: int, epoch: int, n: int) -> list[int]:
        """The chunk each place of epoch `epoch` of data shard `shard` (n chunks) reads."""
        return _permuted(range(n), f"chunks:{self.seed}:{shard}:{epoch}")

    def documents(self, documents: Sequence[T], shard: int, item: int) -> list[T]:
        """Item `item`'s documents in the order it delivers them."""
        return _permuted(documents, f"documents:{self.seed}:{shard}:{item}")


def _permuted(values: Sequence[T], seed: str) -> list[T]:
    out = list(values)
    draw = random.Random(seed).random
    for i in range(len(out) - 1, 0, -1):
        j = int(draw() * (i + 1))
        out[i], out[j] = out[j], out[i]
    return out


def rank_correlation(positions: Sequence[float]) -> float:
    """Spearman's rank correlation between distinct values and their order in the sequence: 1 for
    data read in file order (positions ascending), near 0 for an order unrelated to the files."""
    n = len(positions)
    if n < 2:
        return 1.0
    rank = {p: r for r, p in enumerate(sorted(positions))}
    if len(rank) != n:
        raise ValueError("rank_correlation needs distinct positions")
    squares = sum((rank[p] - i) ** 2 for i, p in enumerate(positions))
    return 1 - 6 * squares / (n * (n * n - 1))
