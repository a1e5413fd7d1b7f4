"""The interface every tokenizer implements, and the one error they raise: apart from
tokenizer.py (which picks a tokenizer from a file), so that the Hugging Face tokenizer
(hf_tokenizer.py) builds on it without an import circle."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod

from torchtitan.errors import UserError


class TokenizerError(UserError, ValueError):
    """The tokenizer file is missing, empty or unreadable; the message names the path."""


class Tokenizer(ABC):
    """What the data pipeline, the model's vocabulary size and the exports read of a tokenizer."""

    n_words: int
    bos_id: int
    eos_id: int
    pad_id: int  # -1 where the tokenizer defines none
    path: str  # the file it was read from

    def fingerprint(self) -> str:
        """The sha256 of the tokenizer's file: pre-tokenized data records it, so that token ids
        are never read with a tokenizer other than the one that made them."""
        digest = hashlib.sha256()
        with open(self.path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()

    def files(self) -> dict[str, str]:
        """The files that make up the tokenizer: the name each takes in an exported Hugging Face
        folder -> its path here. A single-file tokenizer is `tokenizer.model` there (Meta's name)."""
        return {"tokenizer.model": self.path}

    @abstractmethod
    def encode(self, text: str, bos: bool, eos: bool) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: list[int]) -> str: ...
