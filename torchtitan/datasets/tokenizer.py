"""Tokenizers behind one interface, chosen from `model.tokenizer_path`."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

from torchtitan.config_manager import JobConfig


class TokenizerError(ValueError):
    """The tokenizer file is missing, empty or unreadable; the message names the path."""


class Tokenizer(ABC):
    n_words: int
    bos_id: int
    eos_id: int
    pad_id: int  # -1 where the tokenizer defines none

    @abstractmethod
    def encode(self, text: str, bos: bool, eos: bool) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: list[int]) -> str: ...


class SentencePieceTokenizer(Tokenizer):
    """Llama-2 style tokenizer: a sentencepiece `.model` protobuf."""

    def __init__(self, path: str):
        from sentencepiece import SentencePieceProcessor

        _check_file(path)
        self.sp = SentencePieceProcessor()
        try:
            self.sp.Load(path)
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"tokenizer file {path} is not a valid sentencepiece model: {e}") from None
        self.n_words = self.sp.vocab_size()
        self.bos_id, self.eos_id, self.pad_id = self.sp.bos_id(), self.sp.eos_id(), self.sp.pad_id()

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        ids = self.sp.EncodeAsIds(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return self.sp.DecodeIds(list(ids))


def _check_file(path: str) -> None:
    if not os.path.isfile(path):
        raise TokenizerError(f"tokenizer file not found: {path} (set --model.tokenizer_path)")
    if os.path.getsize(path) == 0:
        raise TokenizerError(f"tokenizer file is empty: {path}")


def build_tokenizer(job_config: JobConfig) -> Tokenizer:
    return SentencePieceTokenizer(job_config.model.tokenizer_path)
