"""Packed text batches: documents -> tokens with BOS/EOS -> fixed windows, sharded by data rank.

The document stream is split into `num_shards` shards (document i belongs to shard i % num_shards).
A data-parallel rank owns `num_shards / dp_degree` consecutive shards and builds each batch from
an equal slice of every shard it owns. Hence the global batch of a step depends only on
`num_shards` and the global batch size, not on how many ranks share it: one process reading
2 shards sees exactly what two ranks reading one shard each see together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
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
                 infinite: bool = True, counter: BadLineCounter | None = None, split: Split | None = None):
        self.source, self.tokenizer, self.seq_len = source, tokenizer, seq_len
        self.shard, self.num_shards, self.infinite = shard, num_shards, infinite
        self.split = split
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
        self.exhausted = False  # a finite source came to its end: every later call says so too

    def _next_document(self) -> str | None:
        """The shard's next document; None when a finite source is used up."""
        while not self.exhausted:
            if self._docs is None:
                # Reading continues right after this shard's last document (a resumed run seeks there).
                self._docs = ((d, p) for d, p in read_from(self.source, self.counter, self.position)
                              if (p.index - 1) % self.num_shards == self.shard
                              and (self.split is None or self.split.reads(p.index)))
            doc, position = next(self._docs, (None, None))
            if doc is not None:
                self.docs_done, self.position = self.docs_done + 1, position
                return doc
            if self.docs_done == 0:
                raise DatasetError(self._no_documents())
            if self._whole_epoch and self._epoch_tokens < self.min_epoch_tokens:
                held_out = (f"; training skips the documents validation holds out (validation.held_out_fraction "
                            f"{self.split.fraction:g})" if self.split is not None else "")
                raise DatasetError(
                    f"{_describe(self.source)} gives data shard {self.shard} of {self.num_shards} only "
                    f"{self._epoch_tokens} tokens, fewer than its share of one batch ({self.min_epoch_tokens}){held_out}; "
                    "use more data, or lower training.batch_size, training.seq_len or training.dataset_shards")
            self._epoch_tokens, self._whole_epoch = 0, True
            if not self.infinite:
                self.exhausted = True
                return None
            self.epoch, self.docs_done, self.position, self._docs = self.epoch + 1, 0, StreamPosition(), None
            logger.info(f"data shard {self.shard}: starting epoch {self.epoch} over {_describe(self.source)}")
        return None

    def _no_documents(self) -> str:
        """Why this shard got no document at all, in the words of the option to change."""
        validation = self.split is not None and self.split.validation
        files = self.source if isinstance(self.source, list) else []
        if 0 < len(files) < self.num_shards and all(Path(f).suffix == ".txt" for f in files):
            why = (f"each .txt file is one document, and {len(files)} cannot feed {self.num_shards} data shards (one per "
                   "training.dataset_shards): give more files, or a .jsonl file with one document per line")
        elif validation:
            why = "give more validation data, or lower training.dataset_shards"
        elif self.split is not None:
            why = (f"training skips the documents validation holds out (validation.held_out_fraction "
                   f"{self.split.fraction:g}); lower it, or give more data")
        else:
            why = "it is empty, or has fewer documents than training.dataset_shards"
        data = _describe(self.source)
        if validation and self.split.fraction < 1:
            data = f"the held-out split of {data} (validation.held_out_fraction {self.split.fraction:g})"
        return (f"{'validation: ' if validation else ''}{data} has no documents for data shard {self.shard} of "
                f"{self.num_shards} ({why})")

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


@dataclass(frozen=True)
class Split:
    """Which documents of a source one reader takes when validation holds some of them out.

    Document i (its 1-based position in the source's stream) is held out when a multiplicative
    hash of i falls below `fraction` of the hash range: the split depends only on the document's
    position, so it is the same in every run, layout and data-parallel degree, and held-out
    documents are spread evenly over the source instead of clustering in one shard or file.
    Training reads the rest (`validation` False), validation the held-out ones.
    """

    fraction: float
    validation: bool

    def reads(self, index: int) -> bool:
        held_out = (index * 0x9E3779B1) % 2**32 < self.fraction * 2**32
        return held_out == self.validation


class PackedTextDataset(IterableDataset, Stateful):
    """Yields (inputs, labels) batches of shape (batch_size, seq_len): forever when infinite (each
    shard starts a new epoch at its end), else until a shard cannot fill its part of a batch."""

    def __init__(self, source: Source, tokenizer: Tokenizer, seq_len: int, batch_size: int, shards: list[int],
                 num_shards: int, infinite: bool = True, skip_bad_lines: bool = False, split: Split | None = None):
        if batch_size % len(shards):
            option = "validation.batch_size" if split is not None and split.validation else "training.batch_size"
            raise DatasetError(
                f"{option} {batch_size} must be divisible by the {len(shards)} data shards each rank reads "
                "(training.dataset_shards / data-parallel degree)"
            )
        self.rows_per_shard = batch_size // len(shards)
        counter = BadLineCounter(skip_bad_lines)
        self.packers = [_ShardPacker(source, tokenizer, seq_len, s, num_shards, infinite, counter, split)
                        for s in shards]
        if split is None or not split.validation:  # validation reads its data once, as far as it goes
            for packer in self.packers:
                packer.min_epoch_tokens = self.rows_per_shard * seq_len + 1

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            rows = []
            for packer in self.packers:
                for _ in range(self.rows_per_shard):
                    row = packer.next_window()
                    if row is None:  # a finite shard at its end: no more full batches
                        logger.info(f"data exhausted: {_describe(packer.source)} has no full batch left")
                        return
                    rows.append(row)
            batch = torch.tensor(rows, dtype=torch.long)
            yield batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {f"shard_{p.shard}": p.state_dict() for p in self.packers}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for p in self.packers:
            p.load_state_dict(state_dict[f"shard_{p.shard}"])


def held_out_split(job_config: JobConfig, validation: bool) -> Split | None:
    """The split of the training source between training and validation: None (training reads
    everything) unless validation is on and has no dataset of its own."""
    v = job_config.validation
    if not v.enabled or v.dataset or v.dataset_path:
        return None
    return Split(v.held_out_fraction, validation)


def build_text_dataloader(job_config: JobConfig, tokenizer: Tokenizer, shards: DataShards) -> StatefulDataLoader:
    t = job_config.training
    source = resolve_source(t.dataset, t.dataset_path)
    dataset = PackedTextDataset(source, tokenizer, t.seq_len, t.batch_size, shards.owned, shards.count,
                                infinite=t.dataset_infinite, skip_bad_lines=t.dataset_skip_bad_lines,
                                split=held_out_split(job_config, validation=False))
    # batch_size=None: the dataset yields whole batches (each assembled from its shards).
    return StatefulDataLoader(dataset, batch_size=None, num_workers=0)


def validation_batch_size(job_config: JobConfig) -> int:
    """Rows per data-parallel rank of a validation batch: validation.batch_size, by default the rows
    of one optimizer step (all its micro-batches), so a layout's validation batch, like its training
    step, depends only on the global batch."""
    t, v = job_config.training, job_config.validation
    return v.batch_size if v.batch_size > 0 else t.batch_size * t.gradient_accumulation_steps


def build_validation_dataloader(job_config: JobConfig, tokenizer: Tokenizer, shards: DataShards) -> StatefulDataLoader:
    """Batches of the validation data (validation.dataset or dataset_path, else the training
    source's held-out split), read once from its start: finite, one shard per data-parallel rank."""
    t, v = job_config.training, job_config.validation
    if v.dataset or v.dataset_path:
        source = resolve_source(v.dataset, v.dataset_path, option="validation")
        split = Split(1.0, validation=True)  # all of it
    else:
        source = resolve_source(t.dataset, t.dataset_path)
        split = held_out_split(job_config, validation=True)
    dataset = PackedTextDataset(source, tokenizer, t.seq_len, validation_batch_size(job_config), shards.owned, shards.count,
                                infinite=False, skip_bad_lines=t.dataset_skip_bad_lines, split=split)
    return StatefulDataLoader(dataset, batch_size=None, num_workers=0)


def _describe(source: Source) -> str:
    if isinstance(source, HFSource):
        return f"hub dataset {source.path}"
    if isinstance(source, list):
        return str(source[0]) if len(source) == 1 else f"{len(source)} files from {source[0].parent}"
    return str(source)
