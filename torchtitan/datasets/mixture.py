"""Mixtures of sources: which source each batch row comes from.

`training.dataset_mix = "name_or_path:weight,..."` names the sources and their weights (normalised
to sum to one). Row r of data shard s comes from the source that a hash of (seed, s, r) picks with
those probabilities: the draw depends on nothing but the seed and the row's place, so it is the
same in every layout, resumes exactly from the shards' row counts, and each source's share of the
tokens converges to its weight. Every source keeps its own position in each shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan.datasets.chunks import mix64
from torchtitan.datasets.sources import DATASETS, DatasetError, resolve_source


@dataclass(frozen=True)
class Mixture:
    names: tuple[str, ...]
    sources: tuple[Any, ...]
    weights: tuple[float, ...]  # normalised
    seed: int = 0

    @classmethod
    def single(cls, source: Any, name: str = "") -> Mixture:
        return cls((name,), (source,), (1.0,))

    def describe(self) -> str:
        return ",".join(f"{n}:{w:g}" for n, w in zip(self.names, self.weights))

    def pick(self, shard: int, row: int) -> int:
        """The source of row `row` of data shard `shard`."""
        if len(self.sources) == 1:
            return 0
        u = mix64(mix64(mix64(self.seed) ^ shard) ^ row) / 2**64
        total = 0.0
        for i, weight in enumerate(self.weights):
            total += weight
            if u < total:
                return i
        return len(self.weights) - 1


def parse_mix(text: str, option: str = "training.dataset_mix") -> list[tuple[str, float]]:
    """'a:0.7,b:0.3' -> [(a, 0.7), (b, 0.3)]; a mistake is one line naming the entry."""
    entries = []
    for entry in (e.strip() for e in text.split(",")):
        name, sep, weight = entry.rpartition(":")
        if not entry or not sep or not name.strip():
            raise DatasetError(f"{option} entry {entry!r} is not 'source:weight' (e.g. 'stdlib_docs:0.7,data/code:0.3')")
        try:
            value = float(weight)
        except ValueError:
            raise DatasetError(f"{option} entry {entry!r}: weight {weight!r} is not a number") from None
        if not value > 0 or value == float("inf"):
            raise DatasetError(f"{option} entry {entry!r}: the weight must be a positive number")
        entries.append((name.strip(), value))
    names = [n for n, _ in entries]
    if len(set(names)) != len(names):
        raise DatasetError(f"{option} names a source twice: {text!r}")
    return entries


def build_mixture(mix: str, seed: int, option: str = "training.dataset_mix") -> Mixture:
    """The sources of a mixture: a registered name, else a path (file, folder, glob or a folder of
    pre-tokenized shards)."""
    entries = parse_mix(mix, option)
    sources = tuple(resolve_source(n, "", "training") if n in DATASETS else resolve_source("", n, option.rsplit(".", 1)[0])
                    for n, _ in entries)
    total = sum(w for _, w in entries)
    return Mixture(tuple(n for n, _ in entries), sources, tuple(w / total for _, w in entries), seed)
