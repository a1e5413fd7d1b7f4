"""What one data shard reads, and the stream of tokenized chunks it reads it as.

A source's files are laid end to end in one space (bytes for text files, tokens for pre-tokenized
shards) and data shard s of S owns the range [s/S, (s+1)/S) of it. A document belongs to the shard
whose range holds its first byte (a JSON line's start, a Parquet row group's start, a plain-text
file's start) or its first token (pre-tokenized), so every shard reads about 1/S of the bytes and
the assignment depends only on S and the files, never on how many ranks share the shards.

A shard's range is cut into chunks (about 1 MiB of JSON lines, one Parquet row group, about 256 Ki
pre-tokenized tokens, one plain-text file). Item k of a shard's stream is chunk k mod n of epoch
k div n, tokenized: the item number is the whole reading position, so a resumed run starts at an
item without reading anything before it, and worker processes (text_dataset.py) can each take
every W-th item and still deliver the same stream. With a Shuffle (shuffle.py) an epoch reads the
chunks in a seeded order and each item its documents in a seeded order; the item number stays the
whole position.
Streams (gzip-compressed JSON lines, hub datasets) cannot be planned: they are split by stream
shard and read in order (streams.py).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from torchtitan.datasets import sources
from torchtitan.datasets.shuffle import Shuffle
from torchtitan.datasets.sources import BadLineCounter, ByteCount, DatasetError, GzipFiles, HFSource
from torchtitan.datasets.streams import StreamItems, is_stream
from torchtitan.datasets.tokenized import TokenFiles, TokenizedSource

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # of JSON lines per chunk
CHUNK_TOKENS = 1 << 18  # of pre-tokenized data per chunk


@dataclass(frozen=True)
class Chunk:
    """A piece of file number `file`: bytes [begin, end) of a JSON-lines file (its lines that start
    there), row group `begin` of a Parquet file, a whole plain-text file, or documents [begin, end)
    of a pre-tokenized part. `file` -1: an empty chunk (a shard that owns no document)."""

    file: int
    begin: int
    end: int


EMPTY = Chunk(-1, 0, 0)


@dataclass(frozen=True)
class Split:
    """Which documents one reader takes when validation holds some of them out.

    A document is held out when a hash of its key (its file and its place in that file: byte,
    row or document number) falls below `fraction` of the hash range: the split depends only on
    the document, so it is the same in every run, layout and shard count, and held-out documents
    are spread evenly over the source. Training reads the rest (`validation` False), validation
    the held-out ones.
    """

    fraction: float
    validation: bool

    def reads(self, key: int) -> bool:
        held_out = mix64(key) < self.fraction * 2**64
        return held_out == self.validation


def document_key(file: int, position: int) -> int:
    return (file << 40) + position


def mix64(x: int) -> int:
    """splitmix64's finaliser: neighbouring keys map to unrelated 64-bit values."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def plan_shard(source: Any, shard: int, num_shards: int) -> list[Chunk]:
    """The chunks of data shard `shard` of `num_shards`, in reading order ([EMPTY] when it owns
    no document); a stream has no plan (it is read in order: streams.py)."""
    assert not is_stream(source)
    chunks = _plan_tokens(source, shard, num_shards) if isinstance(source, TokenizedSource) else \
        _plan_files(source, shard, num_shards)
    return chunks or [EMPTY]


def _range(total: int, shard: int, num_shards: int) -> tuple[int, int]:
    return shard * total // num_shards, (shard + 1) * total // num_shards


def _plan_files(files: list[Path], shard: int, num_shards: int) -> list[Chunk]:
    sizes = [f.stat().st_size for f in files]
    lo, hi = _range(sum(sizes), shard, num_shards)
    chunks, start = [], 0
    for n, (path, size) in enumerate(zip(files, sizes)):
        begin, end = max(lo - start, 0), min(hi - start, size)
        if path.suffix == ".jsonl":
            chunks += [Chunk(n, b, min(b + CHUNK_BYTES, end)) for b in range(begin, end, CHUNK_BYTES)]
        elif path.suffix == ".parquet":
            if begin < end:  # only files that overlap the range have their footer read
                groups = sources.parquet_row_groups(sources.open_parquet(path))
                chunks += [Chunk(n, g, g + 1) for g, (at, _) in enumerate(groups) if begin <= at < end]
        elif lo <= start < hi:  # a plain-text file is one document, starting at its first byte
            chunks.append(Chunk(n, 0, size))
        start += size
    return chunks


def _plan_tokens(source: TokenizedSource, shard: int, num_shards: int) -> list[Chunk]:
    lo, hi = _range(source.num_tokens, shard, num_shards)
    files = TokenFiles(source)
    chunks, start = [], 0
    for n, part in enumerate(source.files):
        begin, end = max(lo - start, 0), min(hi - start, part.num_tokens)
        if begin < end:
            starts = files(n)[1][:-1]
            first, stop = (int(torch.searchsorted(starts, torch.tensor(x))) for x in (begin, end))
            while first < stop:  # documents in runs of about CHUNK_TOKENS tokens
                last = int(torch.searchsorted(starts, starts[first] + CHUNK_TOKENS))
                last = min(max(last, first + 1), stop)
                chunks.append(Chunk(n, first, last))
                first = last
        start += part.num_tokens
    return chunks


def source_digest(source: Any) -> str:
    """Names and sizes of a source's files: a saved position refers to the plan of those files."""
    if isinstance(source, HFSource):
        parts = [source.path, str(source.name), source.split]
    elif isinstance(source, GzipFiles):
        parts = [f"{p.name}:{p.stat().st_size}" for p in source.files]
    elif isinstance(source, TokenizedSource):
        parts = [f"{f.tokens}:{f.num_tokens}" for f in source.files]
    else:
        parts = [f"{p.name}:{p.stat().st_size}" for p in ([source] if isinstance(source, Path) else source)]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def describe(source: Any) -> str:
    if isinstance(source, HFSource):
        return f"hub dataset {source.path}"
    if isinstance(source, GzipFiles):
        files = source.files
        return str(files[0]) if len(files) == 1 else f"{len(files)} gzip files from {files[0].parent}"
    if isinstance(source, TokenizedSource):
        return f"pre-tokenized shards in {source.folder}"
    if isinstance(source, list):
        return str(source[0]) if len(source) == 1 else f"{len(source)} files from {source[0].parent}"
    return str(source)


class ShardItems:
    """The tokenized item stream of one data shard of one source (see the module's docstring).

    Item: {"k": its number, "epoch", "last": whether it ends its epoch, "tokens": int32 ids of its
    documents back to back (each BOS ... EOS), "documents", "bytes": read from files, and with
    `lengths` the documents' token counts}, or
    {"k", "error": one line} for a mistake in the data (raised by the consumer, which may be
    another process).
    """

    def __init__(self, source: Any, shard: int, num_shards: int, tokenizer: Any, infinite: bool = True,
                 skip_bad_lines: bool = False, split: Split | None = None, lengths: bool = False,
                 shuffle: Shuffle | None = None, encoder: Any = None):
        self.source = [source] if isinstance(source, Path) else source
        self.shard, self.num_shards = shard, num_shards
        self.tokenizer, self.infinite, self.split = tokenizer, infinite, split
        self.lengths = lengths  # items also list their documents' token counts (for writing token shards)
        self.shuffle = shuffle  # None: the files' order
        # Supervised fine-tuning (chat.ConversationEncoder): each JSON line is checked and encoded by it,
        # and items carry which tokens are targets, and every document's length.
        self.encoder = encoder
        if encoder is not None:
            self.lengths = True
        self.counter = BadLineCounter(skip_bad_lines)
        # A stream (gzip files, a hub dataset) is read in order, by stream shard (streams.py).
        self.stream = StreamItems(source, shard, num_shards, tokenizer, infinite, split, document_key, self.counter,
                                  lengths) if is_stream(source) else None
        self.plan = None if self.stream is not None else plan_shard(self.source, shard, num_shards)
        self.digest = source_digest(self.source)  # of the files the plan was made from
        self._token_files = TokenFiles(source) if isinstance(source, TokenizedSource) else None
        self._parquet: dict[Path, Any] = {}  # open Parquet files (their footers read)
        self._order: tuple[int, list[int]] | None = None  # (epoch, its chunk order) of the last shuffled read
        if shuffle is not None and self.plan is None:
            logger.warning(f"training.dataset_shuffle: {describe(self.source)} is a stream, read in its own order")

    def items(self, start: int = 0, step: int = 1) -> Iterator[dict[str, Any]]:
        """Items start, start + step, ...: forever when infinite, else to the end of the first epoch."""
        if self.stream is not None:
            yield from self.stream.items(start, step)
            return
        k, n = start, len(self.plan)
        while self.infinite or k < n:
            try:
                tokens, lengths, read, targets = self._read(self.plan[self._chunk_index(k, n)], k)
            except DatasetError as e:
                yield {"k": k, "error": str(e)}
                return
            item = {"k": k, "epoch": k // n, "last": k % n == n - 1, "tokens": tokens, "documents": len(lengths),
                    "bytes": read}
            if self.lengths:
                item["lengths"] = lengths
            if targets is not None:
                item["targets"] = targets
            yield item
            k += step

    def _chunk_index(self, k: int, n: int) -> int:
        if self.shuffle is None:
            return k % n
        if self._order is None or self._order[0] != k // n:  # one permutation per epoch, made once per process
            self._order = (k // n, self.shuffle.chunk_order(self.shard, k // n, n))
        return self._order[1][k % n]

    def _read(self, chunk: Chunk, k: int = 0) -> tuple[torch.Tensor, list[int], int, torch.Tensor | None]:
        """Item k's tokens (chunk `chunk`), its documents' token counts, the bytes read, and with an
        encoder which tokens are targets (bool)."""
        empty_targets = None if self.encoder is None else torch.empty(0, dtype=torch.bool)
        if chunk.file < 0:
            return torch.empty(0, dtype=torch.int32), [], 0, empty_targets
        if self._token_files is not None:
            return (*self._read_tokens(chunk, k), None)
        path, read = self.source[chunk.file], ByteCount()
        if self.encoder is not None:
            return self._read_conversations(path, chunk, k, read)
        if path.suffix == ".jsonl":
            documents = sources.read_jsonl(path, chunk.begin, chunk.end, self.counter, read)
        elif path.suffix == ".parquet":
            if path not in self._parquet:  # each process reads a file's footer once
                self._parquet[path] = sources.open_parquet(path, read)
            documents = sources.read_parquet(self._parquet[path], chunk.begin, read)
        else:
            text = sources.read_text_file(path, self.counter, read)
            documents = iter([(text, 0)] if text else [])
        if self.shuffle is not None:
            documents = iter(self.shuffle.documents(list(documents), self.shard, k))
        ids: list[int] = []
        lengths: list[int] = []
        for text, position in documents:
            if self.split is None or self.split.reads(document_key(chunk.file, position)):
                doc = self.tokenizer.encode(text, bos=True, eos=True)
                ids += doc
                lengths.append(len(doc))
        return torch.tensor(ids, dtype=torch.int32), lengths, read.bytes, None

    def _read_conversations(self, path: Path, chunk: Chunk, k: int,
                            read: ByteCount) -> tuple[torch.Tensor, list[int], int, torch.Tensor]:
        """A chunk of a JSON-lines file of conversations (sft.format): ids, lengths, bytes, targets."""
        documents = sources.read_jsonl(path, chunk.begin, chunk.end, self.counter, read, parse=self.encoder.check)
        if self.shuffle is not None:
            documents = iter(self.shuffle.documents(list(documents), self.shard, k))
        ids: list[int] = []
        targets: list[bool] = []
        lengths: list[int] = []
        for checked, position in documents:
            if self.split is None or self.split.reads(document_key(chunk.file, position)):
                try:
                    doc, doc_targets = self.encoder(checked)
                except DatasetError as e:  # the template on this conversation: a bad line like any other
                    self.counter.bad(sources.where(path, position), str(e))
                    continue
                ids += doc
                targets += doc_targets
                lengths.append(len(doc))
        return (torch.tensor(ids, dtype=torch.int32), lengths, read.bytes,
                torch.tensor(targets, dtype=torch.bool))

    def _read_tokens(self, chunk: Chunk, k: int) -> tuple[torch.Tensor, list[int], int]:
        tokens, starts = self._token_files(chunk.file)
        itemsize = tokens.element_size()
        bounds = starts[chunk.begin:chunk.end + 1].tolist()
        index_bytes = len(bounds) * 8
        if self.split is None and self.shuffle is None:  # the documents in order: one slice
            lengths = [b - a for a, b in zip(bounds, bounds[1:])]
            ids = tokens[bounds[0]:bounds[-1]].to(torch.int32)
            self._token_files.check_ids(chunk.file, ids, [(bounds[0], len(ids))])
            return ids, lengths, (bounds[-1] - bounds[0]) * itemsize + index_bytes
        kept = [d for d in range(chunk.end - chunk.begin)
                if self.split is None or self.split.reads(document_key(chunk.file, chunk.begin + d))]
        if self.shuffle is not None:
            kept = self.shuffle.documents(kept, self.shard, k)
        pieces = [tokens[bounds[d]:bounds[d + 1]] for d in kept]
        read = sum(len(p) for p in pieces) * itemsize + index_bytes
        ids = torch.cat(pieces).to(torch.int32) if pieces else torch.empty(0, dtype=torch.int32)
        self._token_files.check_ids(chunk.file, ids, [(bounds[d], len(p)) for d, p in zip(kept, pieces)])
        return ids, [len(p) for p in pieces], read
