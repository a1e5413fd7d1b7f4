"""Byte-level BPE training that writes a tiktoken rank file like Llama 3's `tokenizer.model`.

The rank file has one line per token, `<base64 of the token's bytes> <rank>`. Ranks 0..255 are the
single bytes (rank of byte b is b), so every byte string is encodable; every further rank is the
concatenation of two lower-ranked tokens, in the order the merges were learned. tiktoken encodes by
repeatedly merging the adjacent pair whose concatenation has the lowest rank, so the file alone
(without an explicit merge list) reproduces the training merges.

Text is first split into pieces with Llama 3's pre-tokenisation pattern; merges never cross pieces.
Pure Python, no torch: counts are kept incrementally so each merge touches only the words that
contain the merged pair, and a heap with lazy invalidation finds the most frequent pair.
"""

from __future__ import annotations

import base64
import heapq
import os
from collections import Counter
from collections.abc import Iterable

import regex

# Trained pieces must be the pieces the tokenizer splits text into at run time.
from torchtitan.datasets.tokenizer import LLAMA3_PATTERN

_PIECE_RE = regex.compile(LLAMA3_PATTERN)

Pair = tuple[int, int]
# Heap entry: (-count, left bytes, right bytes, left id, right id). Token bytes are unique per id, so
# the first three fields already order entries totally: highest count, then lexicographically
# smallest (left, right); the ids never take part in a comparison.
_HeapEntry = tuple[int, bytes, bytes, int, int]


def pretokenize(text: str) -> list[str]:
    """Splits text into the pieces that Llama 3's pattern yields; BPE works inside each piece."""
    return _PIECE_RE.findall(text)


def count_pieces(texts: Iterable[str]) -> Counter[bytes]:
    """Counts the UTF-8 bytes of every pre-token piece over all texts."""
    str_counts: Counter[str] = Counter()
    for text in texts:
        str_counts.update(pretokenize(text))
    counts: Counter[bytes] = Counter()
    for piece, n in str_counts.items():
        # "replace" keeps lone surrogates (possible in JSON input) from aborting training.
        counts[piece.encode("utf-8", "replace")] += n
    return counts


def merge_word(word: list[int], left: int, right: int, new_id: int) -> list[int]:
    """Replaces every non-overlapping (left, right) in word, scanning left to right, by new_id."""
    out: list[int] = []
    i, n = 0, len(word)
    while i < n:
        if i + 1 < n and word[i] == left and word[i + 1] == right:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


class _BpeState:
    """Words as token-id lists plus pair -> weighted count, pair -> word indices, and the pair heap."""

    def __init__(self, piece_counts: Counter[bytes]):
        self.vocab: list[bytes] = [bytes([b]) for b in range(256)]
        self.ids: dict[bytes, int] = {tok: i for i, tok in enumerate(self.vocab)}
        # Single-byte pieces hold no pair; sorting makes word indices independent of input order.
        multi = sorted(p for p in piece_counts if len(p) > 1)
        self.words: list[list[int]] = [list(p) for p in multi]
        self.freqs: list[int] = [piece_counts[p] for p in multi]
        self.pair_counts: dict[Pair, int] = {}
        self.where: dict[Pair, set[int]] = {}
        self.heap: list[_HeapEntry] = []
        self._index_all()

    def _index_all(self) -> None:
        """Builds the pair tables from scratch and heapifies one entry per pair."""
        for w, word in enumerate(self.words):
            f = self.freqs[w]
            for pair in zip(word, word[1:]):
                self.pair_counts[pair] = self.pair_counts.get(pair, 0) + f
                self.where.setdefault(pair, set()).add(w)
        self.heap = [self._entry(p, c) for p, c in self.pair_counts.items()]
        heapq.heapify(self.heap)

    def _entry(self, pair: Pair, count: int) -> _HeapEntry:
        """The heap entry for a pair at its current count."""
        return (-count, self.vocab[pair[0]], self.vocab[pair[1]], pair[0], pair[1])

    def pop_best(self) -> tuple[Pair, int] | None:
        """The most frequent pair and its count (ties: smallest bytes), or None when no pair is left."""
        while self.heap:
            neg, _, _, a, b = heapq.heappop(self.heap)
            # Every count change pushes a fresh entry, so an entry that disagrees with the table is stale.
            if self.pair_counts.get((a, b)) == -neg:
                return (a, b), -neg
        return None

    def merge(self, pair: Pair) -> None:
        """Merges pair in every word that has it, updating only those words' pairs."""
        a, b = pair
        merged = self.vocab[a] + self.vocab[b]
        # Defensive: should another split of the same bytes ever win a merge ("ab"+"c" after
        # "a"+"bc"), reuse its id so the rank file never lists a byte string twice.
        new_id = self.ids.get(merged)
        if new_id is None:
            new_id = len(self.vocab)
            self.vocab.append(merged)
            self.ids[merged] = new_id
        delta: dict[Pair, int] = {}
        for w in self.where.pop(pair, ()):
            self._rewrite_word(w, a, b, new_id, delta)
        self._apply_delta(delta)

    def _rewrite_word(self, w: int, a: int, b: int, new_id: int, delta: dict[Pair, int]) -> None:
        """Merges (a, b) in word w, accumulating pair count changes and fixing the word index sets."""
        old = self.words[w]
        new = merge_word(old, a, b, new_id)
        self.words[w] = new
        f = self.freqs[w]
        old_pairs = list(zip(old, old[1:]))
        new_pairs = list(zip(new, new[1:]))
        for p in old_pairs:
            delta[p] = delta.get(p, 0) - f
        for p in new_pairs:
            delta[p] = delta.get(p, 0) + f
        old_set, new_set = set(old_pairs), set(new_pairs)
        for p in old_set - new_set:
            ws = self.where.get(p)
            if ws is not None:  # the merged pair's own set was already popped
                ws.discard(w)
        for p in new_set - old_set:
            self.where.setdefault(p, set()).add(w)

    def _apply_delta(self, delta: dict[Pair, int]) -> None:
        """Applies summed count changes and pushes one heap entry per pair whose count changed."""
        for p, d in delta.items():
            if d == 0:
                continue
            count = self.pair_counts.get(p, 0) + d
            if count > 0:
                self.pair_counts[p] = count
                heapq.heappush(self.heap, self._entry(p, count))
            else:
                self.pair_counts.pop(p, None)
                self.where.pop(p, None)


def train_bpe(texts: Iterable[str], vocab_size: int) -> list[bytes]:
    """Learns byte-level BPE on texts; returns token bytes in rank order, the first 256 being bytes([i])."""
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be >= 256 (the single bytes), got {vocab_size}")
    state = _BpeState(count_pieces(texts))
    while len(state.vocab) < vocab_size:
        best = state.pop_best()
        # A pair seen only once compresses nothing worth a vocabulary slot.
        if best is None or best[1] < 2:
            break
        state.merge(best[0])
    return state.vocab


def save_tiktoken_ranks(tokens: list[bytes], path: str | os.PathLike[str]) -> None:
    """Writes tokens as a tiktoken rank file: `<base64> <rank>` per line, in rank order."""
    if len(set(tokens)) != len(tokens):
        raise ValueError("tokens contain a duplicate byte string; tiktoken ranks must be unique")
    lines = [base64.b64encode(tok) + b" " + str(rank).encode("ascii") + b"\n" for rank, tok in enumerate(tokens)]
    with open(path, "wb") as f:
        f.write(b"".join(lines))
