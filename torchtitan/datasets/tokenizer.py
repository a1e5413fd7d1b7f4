"""Tokenizers behind one interface, chosen from `model.tokenizer_path`."""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from abc import ABC, abstractmethod

from torchtitan.assets import resolve_path
from torchtitan.config.job_config import JobConfig
from torchtitan.errors import UserError

# Llama 3's pre-tokenisation: how text is cut into pieces before byte-pair merges (tiktoken's
# pat_str). The BPE trainer (bpe_trainer.py) cuts its training text the same way.
LLAMA3_PATTERN: str = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TokenizerError(UserError, ValueError):
    """The tokenizer file is missing, empty or unreadable; the message names the path."""


class Tokenizer(ABC):
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

    @abstractmethod
    def encode(self, text: str, bos: bool, eos: bool) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: list[int]) -> str: ...


class SentencePieceTokenizer(Tokenizer):
    """Llama-2 style tokenizer: a sentencepiece `.model` protobuf."""

    def __init__(self, path: str):
        from sentencepiece import SentencePieceProcessor

        _check_file(path)
        self.path = path
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


# Llama 3.1's 256 special tokens, ids right after the base vocabulary (Meta's `tokenizer.model`
# has 128,000 base ranks, so <|begin_of_text|> is 128000 there).
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",  # end of message
    "<|eot_id|>",  # end of turn
    "<|python_tag|>",
]
LLAMA3_SPECIAL_TOKENS += [f"<|reserved_special_token_{i}|>" for i in range(2, 256 - len(LLAMA3_SPECIAL_TOKENS) + 2)]
# tiktoken's regex engine recurses on very long inputs; encode in slices, and cut runs of
# whitespace or of non-whitespace that are longer than a real token could be.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000


class TikTokenizer(Tokenizer):
    """Llama-3 style tokenizer: a tiktoken rank file (base64 token, rank per line) plus Llama 3's
    special tokens and pre-tokenisation pattern, so Meta's own `tokenizer.model` loads unchanged."""

    def __init__(self, path: str):
        import tiktoken

        _check_file(path)
        self.path = path
        ranks = _read_tiktoken_ranks(path)
        n_base = len(ranks)
        special = {token: n_base + i for i, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self.model = tiktoken.Encoding(
            name=os.path.basename(path), pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=special
        )
        self.special_tokens = special
        self.n_words = self.model.n_vocab
        self.bos_id = special["<|begin_of_text|>"]
        self.eos_id = special["<|end_of_text|>"]
        self.pad_id = -1

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        """Special-token strings inside `text` are encoded as ordinary text, never as control tokens."""
        ids = [self.bos_id] if bos else []
        for start in range(0, len(text), _MAX_ENCODE_CHARS):
            for piece in _split_long_runs(text[start : start + _MAX_ENCODE_CHARS]):
                ids.extend(self.model.encode(piece, allowed_special=set(), disallowed_special=()))
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.model.decode(list(ids))


def _read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Parses `<base64 token> <rank>` lines. Read here rather than by tiktoken's loader, which
    caches files by path (a rebuilt file at the same path would load stale) and fetches URLs."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise TokenizerError(f"{path}:{line_no}: not a tiktoken rank line ('<base64> <rank>')") from None
    if not ranks:
        raise TokenizerError(f"tokenizer file {path} holds no tokens")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"tokenizer file {path}: ranks must be 0..{len(ranks) - 1} without gaps or repeats")
    return ranks


def _split_long_runs(text: str):
    """Yields consecutive slices of `text`, none holding a run of >_MAX_RUN_CHARS (non-)spaces."""
    start, run_start, run_is_space = 0, 0, None
    for i, char in enumerate(text):
        is_space = char.isspace()
        if is_space != run_is_space:
            run_start, run_is_space = i, is_space
        elif i - run_start >= _MAX_RUN_CHARS:
            yield text[start:i]
            start = run_start = i
    yield text[start:]


def _looks_like_tiktoken(path: str) -> bool:
    """A tiktoken rank file starts with `<base64> <rank>`; sentencepiece models are binary protobuf."""
    with open(path, "rb") as f:
        first = f.readline(4096).split()
    return len(first) == 2 and first[1].isdigit() and all(c in _BASE64 for c in first[0])


_BASE64 = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=")


def _check_file(path: str, option: str = "--model.tokenizer_path") -> None:
    if os.path.isdir(path):
        candidates = sorted(n for n in os.listdir(path) if n.startswith("tokenizer") or n.endswith((".model", ".tiktoken")))
        hint = f"; it holds {', '.join(candidates)}" if candidates else ""
        raise TokenizerError(f"{option.lstrip('-')} {path} is a folder, not a tokenizer file{hint}")
    if not os.path.isfile(path):
        raise TokenizerError(f"tokenizer file not found: {path} (set {option})")
    if os.path.getsize(path) == 0:
        raise TokenizerError(f"tokenizer file is empty: {path}")


def tokenizer_from_file(path: str, option: str = "--model.tokenizer_path") -> Tokenizer:
    """A tiktoken (Llama 3) or sentencepiece (Llama 2) tokenizer, told apart by the file's content;
    `option` is what a mistake's line tells the user to set."""
    _check_file(path, option)
    return TikTokenizer(path) if _looks_like_tiktoken(path) else SentencePieceTokenizer(path)


def build_tokenizer(job_config: JobConfig) -> Tokenizer:
    """The tokenizer `model.tokenizer_path` names."""
    return tokenizer_from_file(resolve_path(job_config.model.tokenizer_path, "model.tokenizer_path", TokenizerError))
