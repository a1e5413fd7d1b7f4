"""Streaming sources split by data shard: data read in order, never entered at a byte offset.

A stream is a list of stream shards, each read from its start: the files of gzip-compressed JSON
lines (`.jsonl.gz`, `.json.gz`; each file one stream shard) or the files of a Hugging Face hub
dataset (`IterableDataset.n_shards`, one opened as `shard(n_shards, index)`). Both go through the
same splitting code below.

Which stream shards a data shard reads: with n >= S stream shards, data shard s of S reads stream
shards s, s + S, s + 2S, ... (the files `IterableDataset.shard(S, s, contiguous=False)` holds), so
each is read by exactly one data shard; when S does not divide n, shards s < n mod S read one
more file than the others. With n < S every data shard reads the whole stream and keeps record r
of stream shard g when (g + r) mod S == s (one warning says so): every record once, but every data
shard pays for reading everything.

Items: a data shard's stream shards, read in turn, are cut into items of ITEM_DOCUMENTS records
(times S in the fallback, so an item still holds about that many documents); an item never spans
two stream shards, and an empty item marks the end of each epoch. An item's position is
[epoch, stream shard, first record]: the packer saves it (text_dataset.py) and a resumed run opens
that stream shard at that record. A gzip file is decompressed from its start up to the position
(not parsed); the hub's `skip` reads the rows before it too; files before it are not read at all.

Workers: worker w of W takes items w, w + W, ... like a planned source's, but where an item begins
is known only by reading: every worker reads (decompresses, splits into lines or downloads) all of
the data shard's records and parses and tokenizes only its own items. Tokenizing, the costly part,
is divided by W; reading is repeated W times (so W = 1 costs nothing extra).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import torch

from torchtitan.datasets import sources
from torchtitan.datasets.sources import BadLineCounter, ByteCount, DatasetError, GzipFiles, HFSource

logger = logging.getLogger(__name__)

ITEM_DOCUMENTS = 64  # records per item (times the data-shard count when every shard reads the whole stream)
_warned: set[tuple[str, int]] = set()  # (source, data shards) already warned about reading the whole stream


def is_stream(source: Any) -> bool:
    return isinstance(source, (GzipFiles, HFSource))


class GzipStream:
    """Local gzip-compressed JSON lines: file g is stream shard g; a record is a line."""

    def __init__(self, source: GzipFiles):
        self.files = source.files

    def count(self) -> int:
        return len(self.files)

    def records(self, shard: int, skip: int, read: ByteCount) -> Iterator[bytes]:
        return sources.read_gzip_lines(self.files[shard], skip, read)

    def document(self, shard: int, number: int, line: bytes, counter: BadLineCounter) -> str | None:
        return sources.json_text(line, counter, self.files[shard], number + 1)


class HubStream:
    """A hub dataset's files as stream shards (the optional `datasets` package); a record is a row."""

    def __init__(self, source: HFSource):
        self.source = source
        self._hub: Any = None  # loaded once per process (a worker loads its own)

    def __getstate__(self) -> dict[str, Any]:
        return {"source": self.source, "_hub": None}

    def dataset(self) -> Any:
        if self._hub is None:
            self._hub = sources.hub_dataset(self.source)
        return self._hub

    def count(self) -> int:
        return self.dataset().n_shards

    def records(self, shard: int, skip: int, read: ByteCount) -> Iterator[dict[str, Any]]:
        with sources.hub_errors(self.source):
            part = self.dataset().shard(num_shards=self.count(), index=shard)  # that one file's rows
            yield from part.skip(skip) if skip else part

    def document(self, shard: int, number: int, row: Any, counter: BadLineCounter) -> str | None:
        field = self.source.text_field
        text = row.get(field) if isinstance(row, dict) else None
        if not isinstance(text, str):
            counter.bad(f"hub dataset {self.source.path}, file {shard}, row {number}", f"no string {field!r} field")
            return None
        return text or None


class StreamItems:
    """The item stream of one data shard of a stream (see the module's docstring), in the form of
    chunks.ShardItems' items, each with its position ("at") and the next item's ("next")."""

    def __init__(self, source: Any, shard: int, num_shards: int, tokenizer: Any, infinite: bool, split: Any,
                 key: Callable[[int, int], int], counter: BadLineCounter, lengths: bool = False):
        self.stream = GzipStream(source) if isinstance(source, GzipFiles) else HubStream(source)
        self.shard, self.num_shards = shard, num_shards
        self.tokenizer, self.infinite, self.split, self.key = tokenizer, infinite, split, key
        self.counter, self.lengths = counter, lengths
        count = self.stream.count()
        if count >= num_shards:
            self.shards, self.every = list(range(shard, count, num_shards)), 1
        else:
            self.shards, self.every = list(range(count)), num_shards
            name = source.path if isinstance(source, HFSource) else str(source.files[0].parent)
            if (name, num_shards) not in _warned:
                _warned.add((name, num_shards))
                logger.warning(f"{name} has {count} stream shard(s) (files), fewer than the {num_shards} data shards: "
                               "each data shard reads the whole stream and keeps every "
                               f"{num_shards}th document (give at least {num_shards} files to split them)")
        self.per_item = ITEM_DOCUMENTS * self.every
        self.base, self.at = 0, [0, self.shards[0], 0]  # where items() starts: item number and its position

    def seek(self, item: int, at: list[int]) -> None:
        """Start at item `item`, whose position is `at` (a saved position)."""
        self.base, self.at = item, [int(x) for x in at]

    def _index(self, at: list[int]) -> tuple[int, int, int]:
        """(epoch, index in self.shards, record) of a position; stream shard -1 is the epoch's end."""
        epoch, shard, record = at
        if shard == -1:
            return epoch, len(self.shards), 0
        if shard in self.shards:
            return epoch, self.shards.index(shard), record
        # The files changed since the position was saved (the packer warns): the next shard we read.
        return epoch, next((i for i, g in enumerate(self.shards) if g > shard), len(self.shards)), 0

    def items(self, start: int, step: int = 1) -> Iterator[dict[str, Any]]:
        """Items start, start + step, ... (start >= the item seek() named): every item's records
        are read, only these are parsed and tokenized."""
        k, read = self.base, ByteCount()  # read: bytes since this reader's last item (all W readers: W times the data)
        epoch, i, record = self._index(self.at)
        while True:
            if i == len(self.shards):  # the epoch's end
                if k >= start and (k - start) % step == 0:
                    yield self._item(k, epoch, -1, 0, [], read, [epoch + 1, self.shards[0], 0], last=True)
                    read.bytes = 0
                if not self.infinite:
                    return
                k, epoch, i, record = k + 1, epoch + 1, 0, 0
                continue
            g, first, count, mine = self.shards[i], record, 0, []
            after = [epoch, self.shards[i + 1] if i + 1 < len(self.shards) else -1, 0]
            try:
                for rec in self.stream.records(g, record, read):
                    if k >= start and (k - start) % step == 0:
                        mine.append(rec)
                    count += 1
                    if count == self.per_item:
                        if mine:
                            item = self._item(k, epoch, g, first, mine, read, [epoch, g, first + count])
                            yield item
                            if "error" in item:
                                return
                            read.bytes, mine = 0, []
                        k, first, count = k + 1, first + count, 0
            except DatasetError as e:
                yield {"k": k, "error": str(e)}
                return
            if count:  # the shard's last, shorter item
                if mine:
                    item = self._item(k, epoch, g, first, mine, read, after)
                    yield item
                    if "error" in item:
                        return
                    read.bytes = 0
                k += 1
            i, record = i + 1, 0

    def _item(self, k: int, epoch: int, shard: int, first: int, records: list[Any], read: ByteCount,
              after: list[int], last: bool = False) -> dict[str, Any]:
        ids: list[int] = []
        lengths: list[int] = []
        try:
            for number, rec in enumerate(records, start=first):
                if self.every > 1 and (shard + number) % self.every != self.shard:
                    continue  # the whole stream is read by every data shard: one record in S is ours
                if self.split is not None and not self.split.reads(self.key(shard, number)):
                    continue
                text = self.stream.document(shard, number, rec, self.counter)
                if text is not None:
                    doc = self.tokenizer.encode(text, bos=True, eos=True)
                    ids += doc
                    lengths.append(len(doc))
        except DatasetError as e:
            return {"k": k, "error": str(e)}
        item = {"k": k, "epoch": epoch, "last": last, "tokens": torch.tensor(ids, dtype=torch.int32),
                "documents": len(lengths), "bytes": read.bytes, "at": [epoch, shard, first], "next": after}
        if self.lengths:
            item["lengths"] = lengths
        return item
