"""Tokenizers behind one interface, chosen from `model.tokenizer_path`: a tiktoken rank file (Llama 3),
a sentencepiece model (Llama 2), or a Hugging Face tokenizer.json or its folder (hf_tokenizer.py)."""

from __future__ import annotations

import base64
import binascii
import functools
import logging
import os

from torchtitan.assets import resolve_path
from torchtitan.config.job_config import JobConfig, Model
from torchtitan.datasets.hf_tokenizer import HFTokenizer, is_hf_tokenizer
from torchtitan.datasets.tokenizer_base import Tokenizer, TokenizerError

logger = logging.getLogger("torchtitan")

# Llama 3's pre-tokenisation: how text is cut into pieces before byte-pair merges (tiktoken's
# pat_str). The BPE trainer (bpe_trainer.py) cuts its training text the same way.
LLAMA3_PATTERN: str = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


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
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return  # a Hugging Face tokenizer's folder
        candidates = sorted(n for n in os.listdir(path) if n.startswith("tokenizer") or n.endswith((".model", ".tiktoken")))
        hint = f"; it holds {', '.join(candidates)}" if candidates else ""
        raise TokenizerError(f"{option.lstrip('-')} {path} is a folder without a tokenizer.json, not a tokenizer "
                             f"file{hint}")
    if not os.path.isfile(path):
        raise TokenizerError(f"tokenizer file not found: {path} (set {option})")
    if os.path.getsize(path) == 0:
        raise TokenizerError(f"tokenizer file is empty: {path}")


def hf_config_token_ids(tokenizer: Tokenizer) -> dict[str, int | None]:
    """The bos/eos (and pad, where defined) ids as a Hugging Face config.json names them; null where
    the tokenizer has none (Qwen's BOS): left out, transformers would assume Llama's 1 and 2."""
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    ids = {key: (value if value >= 0 else None) for key, value in ids.items()}
    return {**ids, "pad_token_id": tokenizer.pad_id} if tokenizer.pad_id >= 0 else ids


def identifying_file(path: str) -> str:
    """The file whose bytes identify the tokenizer at `path` (what a checkpoint's record of its
    tokenizer hashes): a Hugging Face folder's tokenizer.json, else `path` itself."""
    hf_json = os.path.join(path, "tokenizer.json")
    return hf_json if os.path.isdir(path) and os.path.isfile(hf_json) else path


def tokenizer_from_file(path: str, option: str = "--model.tokenizer_path") -> Tokenizer:
    """A Hugging Face (tokenizer.json or its folder), tiktoken (Llama 3) or sentencepiece (Llama 2)
    tokenizer, told apart by the file's content; `option` is what a mistake's line tells the user to set."""
    _check_file(path, option)
    if is_hf_tokenizer(path):
        return HFTokenizer(path)
    return TikTokenizer(path) if _looks_like_tiktoken(path) else SentencePieceTokenizer(path)


# Where a checkpoint converted by `scripts/convert_checkpoint.py hf-to-dcp` keeps the Hugging Face
# folder's other files verbatim, its tokenizer files among them (checkpoint/hf_folder.py: SIDECAR,
# then "files"; not imported, as that module imports the model registry, which imports this one).
CONVERTED_FILES = os.path.join("hf", "files")


def tokenizer_source(job_config: JobConfig) -> str:
    """What the job's tokenizer is, as `model.tokenizer_path` would name it: that option, unless it
    is left at its default and `checkpoint.initial_load_path` names a folder that carries a Hugging
    Face tokenizer: a Hugging Face folder holding tokenizer.json, or a checkpoint converted from one
    (tokenizer.json in its hf/files/). Then that folder: weights and their vocabulary go together.
    An explicitly set model.tokenizer_path wins (set to the default's value, it reads as left)."""
    option, initial = job_config.model.tokenizer_path, job_config.checkpoint.initial_load_path
    if option != Model().tokenizer_path or not initial:
        return option
    for folder in (initial, os.path.join(initial, CONVERTED_FILES)):
        if os.path.isfile(os.path.join(folder, "tokenizer.json")):
            return folder
    return option


def build_tokenizer(job_config: JobConfig) -> Tokenizer:
    """The tokenizer `tokenizer_source` names, with a notice when it is the initial checkpoint's."""
    source = tokenizer_source(job_config)
    if source != job_config.model.tokenizer_path:
        _notice_once(f"notice: model.tokenizer_path is left at its default, so the tokenizer is the one "
                     f"checkpoint.initial_load_path carries: {source}; set model.tokenizer_path to use another")
    return tokenizer_from_file(resolve_path(source, "model.tokenizer_path", TokenizerError))


@functools.cache
def _notice_once(line: str) -> None:
    """Logs `line` once per process: the tokenizer is built more than once in a run (preflight,
    the Hugging Face export), and its notice need be read once."""
    logger.warning(line)
