"""Packed text batches (the builders of the loaders: text_dataset.py): each data shard's tokenized chunks -> fixed windows -> batches.

The data is split into `num_shards` data shards (chunks.py: byte ranges of the files, Parquet row
groups, token ranges of pre-tokenized shards). A data-parallel rank owns `num_shards / dp_degree`
consecutive shards, reads only those, and builds each batch from an equal slice of every shard it
owns. Hence the global batch of a step depends only on `num_shards` and the global batch size, not
on how many ranks share it: one process reading 2 shards sees exactly what two ranks reading one
shard each see together. With a mixture each row comes from one of several sources (mixture.py).

Reading and tokenizing can run in worker processes (`training.dataset_num_workers` per shard and
source): worker w of W reads items w, w + W, ... of the shard's stream and the loader hands them
over in turn, so the stream, and every batch, is the same with any number of workers. Packing
stays in the training process, and the position it saves (the item its buffer starts with and
the tokens already used from it) is worker-independent too. A stream's items also carry their
position in the stream (streams.py), saved beside the item number.

With `training.dataset_shuffle` each shard reads its chunks, and each chunk its documents, in a
seeded order (shuffle.py) that depends on the seed and the shard only, so all of the above holds;
validation reads in file order.
"""

from __future__ import annotations

import logging
import signal
import warnings
from collections import deque
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.datasets.chunks import ShardItems, Split, describe
from torchtitan.datasets.mixture import Mixture
from torchtitan.datasets.shuffle import Shuffle
from torchtitan.datasets.sources import DatasetError
from torchtitan.datasets.tokenizer import Tokenizer
from torchtitan.runtime.signals import StopRequests

logger = logging.getLogger(__name__)

# A label that carries no loss (F.cross_entropy's default ignore_index): what the losses skip and
# the trainer leaves out of the step's token count (trainer/loss_tokens.py).
IGNORE_INDEX = -100
# torchdata's loader calls a deprecated torch function at every start; nothing for users to act on.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

SHUFFLED = "|shuffled, seed "  # in a saved position's "mix" when training.dataset_shuffle is on

__all__ = ["IGNORE_INDEX", "PackedTextDataset", "own_generator"]


class _WorkerItems(IterableDataset):
    """A shard's items from `start` on, dealt to the loader's workers in turn."""

    def __init__(self, items: ShardItems, start: int):
        self.items, self.start = items, start

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        yield from self.items.items(self.start + worker, workers)


def _ignore_stop_signals(worker: int) -> None:
    """A worker leaves stop signals to the training process: Ctrl-C reaches the whole process
    group and SLURM signals every process of a job, and a worker that died of them (or ran the
    training process's inherited handler) would break the agreed stop and its final save. Workers
    end with the training process."""
    for sig in StopRequests.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class _Packer:
    """Packs one shard's item stream (of one source) into windows of seq_len + 1 tokens.

    Consecutive windows overlap by one token (stride seq_len), so every token except the very
    first is a training target exactly once.
    """

    def __init__(self, items: ShardItems, seq_len: int, workers: int, min_epoch_tokens: int):
        self.items, self.seq_len, self.workers = items, seq_len, workers
        # Tokens one epoch of this shard must give to fill the shard's rows of one batch; fewer
        # means the data is too small to train on (rather than looping over thousands of epochs).
        self.min_epoch_tokens = min_epoch_tokens
        self.parts: deque[tuple[int, torch.Tensor]] = deque()  # items whose tokens are not all used
        self.head = 0  # tokens of parts[0] already used
        self.next_item = 0  # the next item to fetch
        self.counted = 0  # items before this one are in the epoch counts (a resumed run fetches some again)
        self.epoch, self.epoch_tokens, self.epoch_documents = 0, 0, 0
        self.rows = 0  # windows taken from this shard of this source
        self.bytes_read = 0  # by the reads of this process's items (read amplification)
        self.exhausted = False  # a finite source came to its end
        self._stream: Iterator[dict[str, Any]] | None = None
        self._available = 0
        # A stream's positions (streams.py) of the buffered items, and of the item after the last fetched.
        self.positions: dict[int, list[int]] = {}
        self.next_position: list[int] | None = None

    def _fetch(self) -> bool:
        """One more item into the buffer; False when a finite source is used up."""
        if self.exhausted:
            return False
        if self._stream is None:
            self._stream = self._open(self.next_item)
        item = next(self._stream, None)
        if item is None:
            self.exhausted = True
            return False
        if "error" in item:
            raise DatasetError(item["error"])
        if item["k"] != self.next_item:  # the loader hands the workers' items over in turn
            raise RuntimeError(f"data item {item['k']} arrived where {self.next_item} was expected")
        self.next_item += 1
        self.bytes_read += item["bytes"]
        if len(item["tokens"]):
            self.parts.append((item["k"], item["tokens"]))
            self._available += len(item["tokens"])
            self._keep(item)
        if "at" in item:
            self._keep_position(item)
        if item["k"] >= self.counted:
            self.counted = item["k"] + 1
            self.epoch_tokens += len(item["tokens"])
            self.epoch_documents += item["documents"]
            if item["last"]:
                self._end_epoch()
        if item["last"] and not self.items.infinite:
            self.exhausted = True
        return True

    def _keep(self, item: dict[str, Any]) -> None:
        """What a packer keeps of a buffered item besides its tokens (sft.py: targets, lengths)."""

    def _open(self, start: int) -> Iterator[dict[str, Any]]:
        if self.workers == 0:
            return self.items.items(start)
        loader = StatefulDataLoader(_WorkerItems(self.items, start), batch_size=None, num_workers=self.workers,
                                    prefetch_factor=2, worker_init_fn=_ignore_stop_signals, generator=own_generator())
        return iter(loader)

    def _keep_position(self, item: dict[str, Any]) -> None:
        if len(item["tokens"]):
            self.positions[item["k"]] = item["at"]
        self.next_position = item["next"]
        if len(self.positions) > 2 * len(self.parts) + 8:  # forget the items packing has used up
            first = self.parts[0][0] if self.parts else self.next_item
            self.positions = {k: at for k, at in self.positions.items() if k >= first}

    def _end_epoch(self) -> None:
        where = f"data shard {self.items.shard} of {self.items.num_shards}"
        if self.epoch_documents == 0:
            raise DatasetError(self._no_documents())
        if self.epoch_tokens < self.min_epoch_tokens:
            held_out = (f"; training skips the documents validation holds out (validation.held_out_fraction "
                        f"{self.items.split.fraction:g})" if self.items.split is not None else "")
            raise DatasetError(
                f"{describe(self.items.source)} gives {where} only {self.epoch_tokens} tokens, fewer than its share "
                f"of one batch ({self.min_epoch_tokens}){held_out}; use more data, or lower training.batch_size, "
                "training.seq_len or training.dataset_shards")
        self.epoch, self.epoch_tokens, self.epoch_documents = self.epoch + 1, 0, 0
        if self.items.infinite:
            logger.info(f"{where}: starting epoch {self.epoch} over {describe(self.items.source)}")

    def end_of_data(self) -> str:
        """The line for a finite source read to its end: the normal end of a validation's data."""
        split = self.items.split
        if split is not None and split.validation:
            return (f"validation read all of {self._validation_data()}: every full batch it holds (the tokens after "
                    "the last one make no batch)")
        return f"data exhausted: {describe(self.items.source)} has no full batch left"

    def _validation_data(self) -> str:
        split = self.items.split
        data = describe(self.items.source)
        return f"the held-out split of {data} (validation.held_out_fraction {split.fraction:g})" if split.fraction < 1 else data

    def _no_documents(self) -> str:
        """Why this shard got no document in a whole epoch, in the words of the option to change."""
        source, split = self.items.source, self.items.split
        validation = split is not None and split.validation
        files = source if isinstance(source, list) else []
        if files and all(f.suffix == ".txt" for f in files):
            why = (f"each .txt file is one document, and {len(files)} cannot feed {self.items.num_shards} data shards "
                   "(training.dataset_shards): give more files, or a .jsonl file with one document per line")
        elif files and all(f.suffix == ".parquet" for f in files):
            why = ("Parquet files are split by row group, and too few start in this shard's byte range: write "
                   "smaller row groups, or lower training.dataset_shards")
        elif validation:
            why = "give more validation data, or lower training.dataset_shards"
        elif split is not None:
            why = (f"training skips the documents validation holds out (validation.held_out_fraction "
                   f"{split.fraction:g}); lower it, or give more data")
        else:
            why = "it is empty, or too small for training.dataset_shards"
        data = self._validation_data() if validation else describe(source)
        return (f"{'validation: ' if validation else ''}{data} has no documents for data shard {self.items.shard} of "
                f"{self.items.num_shards} ({why})")

    def next_window(self) -> torch.Tensor | None:
        """seq_len + 1 tokens (int32); None when a finite source cannot fill another window."""
        need = self.seq_len + 1
        while self._available - self.head < need:
            if not self._fetch():
                return None
        pieces, missing, head = [], need, self.head
        for _, tokens in self.parts:
            pieces.append(tokens[head:head + missing])
            missing, head = missing - len(pieces[-1]), 0
            if missing == 0:
                break
        # Advance by seq_len: the window's last token starts the next one.
        self.head += self.seq_len
        while self.parts and self.head >= len(self.parts[0][1]):
            _, done = self.parts.popleft()
            self.head -= len(done)
            self._available -= len(done)
        self.rows += 1
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def state_dict(self) -> dict[str, Any]:
        first = self.parts[0][0] if self.parts else self.next_item
        return {"item": first, "offset": self.head, "counted": self.counted, "epoch": self.epoch,
                "epoch_tokens": self.epoch_tokens, "epoch_documents": self.epoch_documents, "rows": self.rows,
                "files": self.items.digest, **self._stream_position(first)}

    def _stream_position(self, first: int) -> dict[str, Any]:
        """A stream's item `first` cannot be found by its number: its position is saved with it."""
        if self.items.stream is None:
            return {}
        at = self.positions.get(first, self.next_position) if (self.parts or self.next_position) else self.items.stream.at
        return {"at": list(at)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["files"] != self.items.digest:
            logger.warning(f"the files of {describe(self.items.source)} changed since this data position was saved "
                           f"(data shard {self.items.shard} of {self.items.num_shards}); reading goes on at its chunk "
                           f"{state['item']} of the files as they are now, which may hold other documents")
        self.parts.clear()
        self._available, self._stream, self.exhausted = 0, None, False
        self.next_item, self.head, self.counted = int(state["item"]), int(state["offset"]), int(state["counted"])
        self.epoch, self.epoch_tokens = int(state["epoch"]), int(state["epoch_tokens"])
        self.epoch_documents, self.rows = int(state["epoch_documents"]), int(state["rows"])
        self.positions, self.next_position = {}, None
        if self.items.stream is not None:
            if "at" not in state:
                raise DatasetError(f"the checkpoint's data position in {describe(self.items.source)} has no stream "
                                   "position (it predates streams split by file); start the data over with "
                                   "--checkpoint.exclude_from_loading dataloader")
            self.items.stream.seek(self.next_item, state["at"])


class PackedTextDataset(IterableDataset, Stateful):
    """Yields (inputs, labels) batches of shape (batch_size, seq_len): forever when infinite (each
    shard starts a new epoch at its end), else until a shard cannot fill its part of a batch.

    `source` is one source (files, pre-tokenized shards, a hub dataset) or a Mixture of several.
    `ignore_after`: a token id (end-of-text) whose next token is no target: the label at each
    position whose input is that token is IGNORE_INDEX (training.mask_loss_after_eos)."""

    def __init__(self, source: Any, tokenizer: Tokenizer, seq_len: int, batch_size: int, shards: list[int],
                 num_shards: int, infinite: bool = True, skip_bad_lines: bool = False, split: Split | None = None,
                 num_workers: int = 0, ignore_after: int | None = None, shuffle: Shuffle | None = None):
        if batch_size % len(shards):
            option = "validation.batch_size" if split is not None and split.validation else "training.batch_size"
            raise DatasetError(
                f"{option} {batch_size} must be divisible by the {len(shards)} data shards each rank reads "
                "(training.dataset_shards / data-parallel degree)"
            )
        self.mixture = source if isinstance(source, Mixture) else Mixture.single(source)
        self.seq_len, self.rows_per_shard = seq_len, batch_size // len(shards)
        # Validation reads its data once, as far as it goes: no minimum.
        min_tokens = self.rows_per_shard * seq_len + 1 if split is None or not split.validation else 0
        self.packers = {s: [self._packer(ShardItems(src, s, num_shards, tokenizer, infinite, skip_bad_lines, split,
                                                    shuffle=shuffle, encoder=self._encoder()),
                                         seq_len, num_workers, min_tokens)
                            for src in self.mixture.sources] for s in shards}
        self.rows = dict.fromkeys(shards, 0)  # rows drawn in each shard: the mixture's draw counter
        self.shuffle = shuffle
        self.ignore_after = ignore_after

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            rows = []
            for shard, packers in self.packers.items():
                for _ in range(self.rows_per_shard):
                    packer = packers[self.mixture.pick(shard, self.rows[shard])]
                    row = packer.next_window()
                    if row is None:  # a finite shard at its end: no more full batches
                        logger.info(packer.end_of_data())
                        return
                    self.rows[shard] += 1
                    rows.append(row)
            yield self._batch(rows)

    def _packer(self, items: ShardItems, seq_len: int, workers: int, min_epoch_tokens: int) -> _Packer:
        return _Packer(items, seq_len, workers, min_epoch_tokens)

    def _encoder(self) -> Any:
        """What turns a JSON line into ids and targets (supervised fine-tuning: sft.py); None: text."""
        return None

    def _batch(self, rows: list[Any]) -> tuple[torch.Tensor, ...]:
        batch = torch.stack(rows).long()
        inputs, labels = batch[:, :-1], batch[:, 1:]
        if self.ignore_after is not None:
            labels = labels.masked_fill(inputs == self.ignore_after, IGNORE_INDEX)
        return inputs, labels

    def tokens_by_source(self) -> dict[str, int]:
        """Training tokens (labels) this rank took from each source so far."""
        return {name: sum(packers[i].rows for packers in self.packers.values()) * self.seq_len
                for i, name in enumerate(self.mixture.names)}

    def bytes_read(self) -> int:
        return sum(p.bytes_read for packers in self.packers.values() for p in packers)

    def _order(self) -> str:
        return "" if self.shuffle is None else str(self.shuffle.seed)

    def state_dict(self) -> dict[str, Any]:
        # The shuffle rides in "mix" (sources and weights, then SHUFFLED and the seed when on), not in a
        # key of its own: a checkpoint is loaded into this run's keys, so a new key would make every
        # older checkpoint incomplete, and one absent here would be dropped unread.
        mix = self.mixture.describe() + (SHUFFLED + self._order() if self.shuffle is not None else "")
        return {f"shard_{s}": {"rows": self.rows[s], "mix": mix,
                               **{f"source_{i}": p.state_dict() for i, p in enumerate(packers)}}
                for s, packers in self.packers.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for s, packers in self.packers.items():
            state = state_dict[f"shard_{s}"]
            mix, _, order = state["mix"].partition(SHUFFLED)
            if mix != self.mixture.describe():
                raise DatasetError(f"the checkpoint's data position is for the sources {mix!r}, but this run "
                                   f"reads {self.mixture.describe()!r} (training.dataset_mix); resume with the same "
                                   "sources and weights, or start the data over with --checkpoint.exclude_from_loading "
                                   "dataloader")
            if order != self._order():  # the same item number is another chunk in another order
                def named(seed: str) -> str:
                    return f"the shuffled order of seed {seed}" if seed else "file order"

                raise DatasetError(f"the checkpoint's data position is for {named(order)}, but this run reads "
                                   f"{', '.join(describe(src) for src in self.mixture.sources)} in {named(self._order())} "
                                   "(training.dataset_shuffle, "
                                   "training.seed); resume with the same, or start the data over with "
                                   "--checkpoint.exclude_from_loading dataloader")
            self.rows[s] = int(state["rows"])
            for i, packer in enumerate(packers):
                packer.load_state_dict(state[f"source_{i}"])


def own_generator() -> torch.Generator:
    """A generator of a loader's own. Starting an iterator draws a seed from the generator a loader
    is given, torch's global one by default: every validation, every start of the shard readers'
    workers, and a resumed run's first loader (started after the checkpoint restored the random
    state) would move the training's random state, and a resumed run would draw ahead of the
    uninterrupted one. Nothing here uses the seed (shuffling has its own, training.seed)."""
    return torch.Generator()
