"""Packed text batches: documents -> tokens with BOS/EOS -> fixed windows, sharded by data rank.

The document stream is split into `num_shards` shards (document i belongs to shard i % num_shards).
A data-parallel rank owns `num_shards / dp_degree` consecutive shards and builds each batch from
an equal slice of every shard it owns. Hence the global batch of a step depends only on
`num_shards` and the global batch size, not on how many ranks share it: one process reading
2 shards sees exactly what two ranks reading one shard each see together.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.datasets.shards import DataShards
from torchtitan.datasets.sources import BadLineCounter, DatasetError, HFSource, StreamPosition, read_from, resolve_source
from torchtitan.datasets.tokenizer import Tokenizer
from torchtitan.job_config import JobConfig

logger = logging.getLogger(__name__)
Source = Any  # a Path, a list of Paths or an HFSource (see sources.py)


class _ShardPacker:
    """Packs the documents of one shard into windows of seq_len + 1 tokens.

    Consecutive windows overlap by one token (stride seq_len), so every token except the very
    first is a training target exactly once.
    """

    def __init__(self, source: Source, tokenizer: Tokenizer, seq_len: int, shard: int, num_shards: int,
                 infinite: bool = True, counter: BadLineCounter | None = None):
        self.source, self.tokenizer, self.seq_len = source, tokenizer, seq_len
        self.shard, self.num_shards, self.infinite = shard, num_shards, infinite
        self.counter = counter or BadLineCounter()
        self.docs_done = 0  # documents of this shard consumed in the current epoch
        self.epoch = 0
        self.position = StreamPosition()  # in the source's stream, just after the last of them
        self.buffer: list[int] = []
        self._docs: Iterator[str] | None = None
        # Tokens one epoch of this shard must give to fill the shard's rows of one batch; an epoch
        # seen whole (not resumed midway) that gives fewer means the data is too small to train on.
        self.min_epoch_tokens = 0
        self._epoch_tokens, self._whole_epoch = 0, True

    def _next_document(self) -> str | None:
        """The shard's next document; None when a finite source is used up."""
        while True:
            if self._docs is None:
                # Reading continues right after this shard's last document (a resumed run seeks there).
                self._docs = ((d, p) for d, p in read_from(self.source, self.counter, self.position)
                              if (p.index - 1) % self.num_shards == self.shard)
            doc, position = next(self._docs, (None, None))
            if doc is not None:
                self.docs_done, self.position = self.docs_done + 1, position
                return doc
            if self.docs_done == 0:
                files = self.source if isinstance(self.source, list) else []
                only_txt = 0 < len(files) < self.num_shards and all(Path(f).suffix == ".txt" for f in files)
                why = (f"each .txt file is one document, and {len(files)} cannot feed {self.num_shards} data shards: give "
                       "more files, or a .jsonl file with one document per line" if only_txt
                       else "it is empty, or has fewer documents than training.dataset_shards")
                raise DatasetError(
                    f"{_describe(self.source)} has no documents for data shard {self.shard} of {self.num_shards} ({why})")
            if self._whole_epoch and self._epoch_tokens < self.min_epoch_tokens:
                raise DatasetError(
                    f"{_describe(self.source)} gives data shard {self.shard} of {self.num_shards} only "
                    f"{self._epoch_tokens} tokens, fewer than its share of one batch ({self.min_epoch_tokens}); use more "
                    "data, or lower training.batch_size, training.seq_len or training.dataset_shards")
            self._epoch_tokens, self._whole_epoch = 0, True
            if not self.infinite:
                return None
            self.epoch, self.docs_done, self.position, self._docs = self.epoch + 1, 0, StreamPosition(), None
            logger.info(f"data shard {self.shard}: starting epoch {self.epoch} over {_describe(self.source)}")

    def next_window(self) -> list[int] | None:
        """seq_len + 1 tokens; None when a finite source cannot fill another window."""
        while len(self.buffer) < self.seq_len + 1:
            doc = self._next_document()
            if doc is None:
                return None
            tokens = self.tokenizer.encode(doc, bos=True, eos=True)
            self._epoch_tokens += len(tokens)
            self.buffer.extend(tokens)
        window = self.buffer[: self.seq_len + 1]
        self.buffer = self.buffer[self.seq_len :]
        return window

    def state_dict(self) -> dict[str, Any]:
        return {"docs_done": self.docs_done, "epoch": self.epoch, "buffer": list(self.buffer),
                "position": self.position.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.docs_done, self.epoch, self.buffer = state["docs_done"], state["epoch"], list(state["buffer"])
        self.position = StreamPosition.from_state_dict(state["position"])
        self._docs = None
        self._epoch_tokens, self._whole_epoch = 0, self.docs_done == 0


class PackedTextDataset(IterableDataset, Stateful):
    """Yields (inputs, labels) batches of shape (batch_size, seq_len): forever when infinite (each
    shard starts a new epoch at its end), else until a shard cannot fill its part of a batch."""

    def __init__(self, source: Source, tokenizer: Tokenizer, seq_len: int, batch_size: int, shards: list[int],
                 num_shards: int, infinite: bool = True, skip_bad_lines: bool = False):
        if batch_size % len(shards):
            raise DatasetError(
                f"training.batch_size {batch_size} must be divisible by the {len(shards)} data shards each rank reads "
                "(training.dataset_shards / data-parallel degree)"
            )
        self.rows_per_shard = batch_size // len(shards)
        counter = BadLineCounter(skip_bad_lines)
        self.packers = [_ShardPacker(source, tokenizer, seq_len, s, num_shards, infinite, counter) for s in shards]
        for packer in self.packers:
            packer.min_epoch_tokens = self.rows_per_shard * seq_len + 1

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            rows = [p.next_window() for p in self.packers for _ in range(self.rows_per_shard)]
            if any(row is None for row in rows):
                logger.info(f"data exhausted: {_describe(self.packers[0].source)} has no full batch left")
                return
            batch = torch.tensor(rows, dtype=torch.long)
            yield batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {f"shard_{p.shard}": p.state_dict() for p in self.packers}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for p in self.packers:
            p.load_state_dict(state_dict[f"shard_{p.shard}"])


def build_text_dataloader(job_config: JobConfig, tokenizer: Tokenizer, shards: DataShards) -> StatefulDataLoader:
    t = job_config.training
    source = resolve_source(t.dataset, t.dataset_path)
    dataset = PackedTextDataset(source, tokenizer, t.seq_len, t.batch_size, shards.owned, shards.count,
                                infinite=t.dataset_infinite, skip_bad_lines=t.dataset_skip_bad_lines)
    # batch_size=None: the dataset yields whole batches (each assembled from its shards).
    return StatefulDataLoader(dataset, batch_size=None, num_workers=0)


def _describe(source: Source) -> str:
    if isinstance(source, HFSource):
        return f"hub dataset {source.path}"
    if isinstance(source, list):
        return str(source[0]) if len(source) == 1 else f"{len(source)} files from {source[0].parent}"
    return str(source)
