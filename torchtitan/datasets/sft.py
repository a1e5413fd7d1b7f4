"""Supervised fine-tuning batches: whole conversations packed into rows, loss on the answers only.

The training source is JSON lines of conversations (`sft.format`; chat.py turns each into ids and
which of them are targets). Reading, sharding over data-parallel ranks, shuffling, worker
processes and the saved position are those of text data (chunks.py, text_dataset.py); what
differs is the packing. A row of seq_len + 1 tokens holds whole conversations back to back
(`sft.packing`) or one conversation (padded); a conversation never continues into the next row,
since its answers need their prompt. The rest of a row is padding. Each batch is (inputs, labels,
document ids): labels are -100 except where the next token is a target, and the document ids
(each conversation, and the padding, a document of its own) keep attention inside each
conversation, whatever `training.document_mask` says (the step hands the model a batch's own ids).
One conversation a row comes without ids: its padding follows it, so causal attention suffices.

A conversation longer than a row is truncated to the row (its first tokens) or dropped
(`sft.overlong`); one whose kept part has no target is dropped either way. Both are counted,
logged and saved with the data position.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from torchtitan.config.job_config import JobConfig
from torchtitan.datasets.chat import ConversationEncoder, chat_template_for
from torchtitan.datasets.chunks import ShardItems, describe
from torchtitan.datasets.packing import IGNORE_INDEX, PackedTextDataset, _Packer
from torchtitan.datasets.tokenizer import Tokenizer
from torchtitan.errors import DatasetError

logger = logging.getLogger(__name__)


class ConversationPacker(_Packer):
    """One data shard's conversations -> rows (tokens, targets, document ids) of seq_len + 1.

    The saved position is the base packer's: the first buffered item and, in `offset`, how many of
    its conversations are used."""

    def __init__(self, items: ShardItems, seq_len: int, workers: int, packing: bool, overlong: str, pad_id: int):
        super().__init__(items, seq_len, workers, min_epoch_tokens=0)
        self.packing, self.overlong, self.pad_id = packing, overlong, pad_id
        self.kept: dict[int, tuple[torch.Tensor, list[int]]] = {}  # item -> (targets, conversation starts)
        self.truncated = self.dropped = 0
        self.placed_at = 0  # the item after the one the last conversation placed in a row came from

    def _keep(self, item: dict[str, Any]) -> None:
        starts = [0]
        for n in item["lengths"]:
            starts.append(starts[-1] + n)
        self.kept[item["k"]] = (item["targets"], starts)

    def _peek(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The next conversation's (ids, targets), None when a finite source is used up."""
        while True:
            if self.parts:
                k, tokens = self.parts[0]
                targets, starts = self.kept[k]
                if self.head < len(starts) - 1:
                    a, b = starts[self.head], starts[self.head + 1]
                    return tokens[a:b], targets[a:b]
                self.parts.popleft()
                del self.kept[k]
                self.head = 0
            elif not self._fetch():
                return None
            # Every item of two whole epochs read since a conversation last fitted: none ever will.
            if self.items.plan is not None and self.next_item - self.placed_at > 2 * len(self.items.plan) + 1:
                advice = ("or use sft.overlong truncate" if self.overlong == "drop"
                          else "or give conversations whose answers start within it")
                raise DatasetError(
                    f"no conversation of {describe(self.items.source)} (data shard {self.items.shard} of "
                    f"{self.items.num_shards}) fits in training.seq_len + 1 = {self.seq_len + 1} tokens with a "
                    f"target left (sft.overlong {self.overlong}); raise training.seq_len {advice}")

    def next_window(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        row = self.seq_len + 1
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        used = 0
        while not pieces or self.packing:
            conversation = self._peek()
            if conversation is None:
                break
            ids, targets = conversation
            too_long = len(ids) > row
            if too_long and (self.overlong == "drop" or not bool(targets[1:row].any())):
                self.head += 1
                self._count("dropped", len(ids))
                continue
            length = min(len(ids), row)
            if used + length > row:
                break  # the next row starts with it
            self.head += 1
            if too_long:
                self._count("truncated", len(ids))
            pieces.append((ids[:length], targets[:length]))
            used += length
            self.placed_at = self.next_item
        if not pieces:
            return None
        tokens = torch.full((row,), self.pad_id, dtype=torch.int32)
        targets = torch.zeros(row, dtype=torch.bool)
        documents = torch.full((row,), len(pieces), dtype=torch.int32)  # the padding: a document of its own
        at = 0
        for number, (ids, marks) in enumerate(pieces):
            tokens[at:at + len(ids)], targets[at:at + len(ids)], documents[at:at + len(ids)] = ids, marks, number
            at += len(ids)
        self.rows += 1
        return tokens, targets, documents

    def _count(self, what: str, length: int) -> None:
        setattr(self, what, getattr(self, what) + 1)
        total = self.truncated + self.dropped
        if total == 1 or total % 1000 == 0:
            logger.warning(f"data shard {self.items.shard} of {self.items.num_shards}: a conversation of {length} "
                           f"tokens is longer than training.seq_len + 1 = {self.seq_len + 1} and was {what} "
                           f"(sft.overlong {self.overlong}); so far {self.truncated} truncated, {self.dropped} dropped")

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "truncated": self.truncated, "dropped": self.dropped,
                "placed_at": self.placed_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.kept.clear()
        self.truncated, self.dropped = int(state["truncated"]), int(state["dropped"])
        self.placed_at = int(state["placed_at"])


class ConversationDataset(PackedTextDataset):
    """Yields (inputs, labels, document ids) batches of conversations (see the module docstring)."""

    def __init__(self, source: Any, tokenizer: Tokenizer, encoder: ConversationEncoder, seq_len: int,
                 batch_size: int, shards: list[int], num_shards: int, packing: bool, overlong: str, **kwargs: Any):
        self.encoder, self.packing, self.overlong = encoder, packing, overlong
        # Padding is never a target nor attended from a conversation; any id the model knows will do.
        self.pad_id = next(i for i in (tokenizer.pad_id, tokenizer.eos_id, 0) if i >= 0)
        super().__init__(source, tokenizer, seq_len, batch_size, shards, num_shards, **kwargs)

    def _encoder(self) -> ConversationEncoder:
        return self.encoder

    def _packer(self, items: ShardItems, seq_len: int, workers: int, min_epoch_tokens: int) -> ConversationPacker:
        return ConversationPacker(items, seq_len, workers, self.packing, self.overlong, self.pad_id)

    def _batch(self, rows: list[Any]) -> tuple[torch.Tensor, ...]:
        """(inputs, labels, document ids) of packed rows; (inputs, labels) of one conversation a row,
        whose padding comes after it, so plain causal attention keeps it to itself."""
        tokens, targets, documents = (torch.stack(part) for part in zip(*rows))
        tokens = tokens.long()
        labels = tokens[:, 1:].masked_fill(~targets[:, 1:], IGNORE_INDEX)
        return (tokens[:, :-1], labels, documents[:, :-1]) if self.packing else (tokens[:, :-1], labels)

    def conversations_cut(self) -> dict[str, int]:
        """Conversations truncated and dropped so far by this rank (sft.overlong)."""
        packers = [p for ps in self.packers.values() for p in ps]
        return {"truncated": sum(p.truncated for p in packers), "dropped": sum(p.dropped for p in packers)}


def conversation_encoder(job_config: JobConfig, tokenizer: Tokenizer) -> ConversationEncoder:
    sft = job_config.sft
    template = chat_template_for(tokenizer, sft.chat_template) if sft.format == "chat" else None
    if sft.format == "prompt_completion" and tokenizer.eos_id < 0:
        raise DatasetError(f"sft.format prompt_completion ends each completion with the end-of-text token, which "
                           f"tokenizer {tokenizer.path} has not; use a tokenizer with one")
    return ConversationEncoder(tokenizer, sft.format, template)


def check_source(source: Any, option: str) -> None:
    """Conversations are read from JSON-lines files only (each line one conversation)."""
    files = source if isinstance(source, list) else [source] if isinstance(source, Path) else None
    if files is None or any(f.suffix != ".jsonl" for f in files):
        raise DatasetError(f"sft.format reads conversations from JSON-lines files (.jsonl), one per line; "
                           f"{option} names {describe(source)}")


def conversation_dataset(job_config: JobConfig, tokenizer: Tokenizer, source: Any, option: str, batch_size: int,
                         shards: list[int], num_shards: int, **kwargs: Any) -> ConversationDataset:
    check_source(source, option)
    sft, training = job_config.sft, job_config.training
    return ConversationDataset(source, tokenizer, conversation_encoder(job_config, tokenizer), training.seq_len,
                               batch_size, shards, num_shards, sft.packing, sft.overlong, **kwargs)
