"""Packed text batches: documents -> tokens with BOS/EOS -> fixed windows, sharded by data rank.

The document stream is split into `num_shards` shards (document i belongs to shard i % num_shards).
A data-parallel rank owns `num_shards / dp_degree` consecutive shards and builds each batch from
an equal slice of every shard it owns. Hence the global batch of a step depends only on
`num_shards` and the global batch size, not on how many ranks share it: one process reading
2 shards sees exactly what two ranks reading one shard each see together.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.config_manager import JobConfig
from torchtitan.datasets.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
# Registered text sources: short name -> local path (relative to the repository root).
DATASETS = {
    # Docstrings of Python's standard library, about 1 MB (tests/assets/stdlib_docs/README.md).
    "stdlib_docs": "tests/assets/stdlib_docs/corpus.jsonl",
}


class DatasetError(ValueError):
    """A dataset name or file the user can fix; the message names it."""


def resolve_dataset_path(name: str, dataset_path: str) -> Path:
    if dataset_path:
        path = Path(dataset_path)
    elif name in DATASETS:
        path = REPO_ROOT / DATASETS[name]
    else:
        raise DatasetError(f"unknown training.dataset {name!r}; known: {', '.join(sorted(DATASETS))} "
                           "(or set training.dataset_path to a local file)")
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    return path


def read_documents(path: Path) -> Iterator[str]:
    """Documents of a JSON-lines file (its `text` fields) or of a plain text file (the whole file)."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        yield json.loads(line)["text"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise DatasetError(f"{path}:{line_no}: not a JSON object with a 'text' field") from None
    else:
        yield path.read_text(encoding="utf-8")


class _ShardPacker:
    """Packs the documents of one shard into windows of seq_len + 1 tokens.

    Consecutive windows overlap by one token (stride seq_len), so every token except the very
    first is a training target exactly once.
    """

    def __init__(self, path: Path, tokenizer: Tokenizer, seq_len: int, shard: int, num_shards: int):
        self.path, self.tokenizer, self.seq_len = path, tokenizer, seq_len
        self.shard, self.num_shards = shard, num_shards
        self.docs_done = 0  # documents of this shard consumed in the current epoch
        self.epoch = 0
        self.buffer: list[int] = []
        self._docs: Iterator[str] | None = None

    def _next_document(self) -> str:
        while True:
            if self._docs is None:
                mine = (d for i, d in enumerate(read_documents(self.path)) if i % self.num_shards == self.shard)
                for _ in range(self.docs_done):  # resume: skip what earlier runs consumed
                    next(mine)
                self._docs = mine
            doc = next(self._docs, None)
            if doc is not None:
                self.docs_done += 1
                return doc
            if self.docs_done == 0:
                raise DatasetError(f"{self.path} has no documents for data shard {self.shard} of {self.num_shards}")
            self.epoch, self.docs_done, self._docs = self.epoch + 1, 0, None
            logger.info(f"data shard {self.shard}: starting epoch {self.epoch} over {self.path}")

    def next_window(self) -> list[int]:
        while len(self.buffer) < self.seq_len + 1:
            self.buffer.extend(self.tokenizer.encode(self._next_document(), bos=True, eos=True))
        window = self.buffer[: self.seq_len + 1]
        self.buffer = self.buffer[self.seq_len :]
        return window

    def state_dict(self) -> dict[str, Any]:
        return {"docs_done": self.docs_done, "epoch": self.epoch, "buffer": list(self.buffer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.docs_done, self.epoch, self.buffer = state["docs_done"], state["epoch"], list(state["buffer"])
        self._docs = None


class PackedTextDataset(IterableDataset, Stateful):
    """Yields (inputs, labels) batches of shape (batch_size, seq_len), forever."""

    def __init__(self, path: Path, tokenizer: Tokenizer, seq_len: int, batch_size: int, shards: list[int], num_shards: int):
        if batch_size % len(shards):
            raise DatasetError(
                f"training.batch_size {batch_size} must be divisible by the {len(shards)} data shards each rank reads "
                "(training.dataset_shards / data-parallel degree)"
            )
        self.rows_per_shard = batch_size // len(shards)
        self.packers = [_ShardPacker(path, tokenizer, seq_len, s, num_shards) for s in shards]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            rows = [p.next_window() for p in self.packers for _ in range(self.rows_per_shard)]
            batch = torch.tensor(rows, dtype=torch.long)
            yield batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {f"shard_{p.shard}": p.state_dict() for p in self.packers}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for p in self.packers:
            p.load_state_dict(state_dict[f"shard_{p.shard}"])


def build_text_dataloader(job_config: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_degree: int) -> StatefulDataLoader:
    t = job_config.training
    num_shards = dp_degree if t.dataset_shards == -1 else t.dataset_shards
    if num_shards % dp_degree:
        raise DatasetError(
            f"training.dataset_shards {num_shards} must be a multiple of the data-parallel degree {dp_degree}"
        )
    per_rank = num_shards // dp_degree
    shards = list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))
    path = resolve_dataset_path(t.dataset, t.dataset_path)
    dataset = PackedTextDataset(path, tokenizer, t.seq_len, t.batch_size, shards, num_shards)
    # batch_size=None: the dataset yields whole batches (each assembled from its shards).
    return StatefulDataLoader(dataset, batch_size=None, num_workers=0)
