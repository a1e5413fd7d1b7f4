"""Pre-tokenized shards: token ids on disk, memory-mapped by the trainer with no tokenizing cost.

A folder made by scripts/tokenize_dataset.py holds `manifest.json` and, per part, `<part>.bin`
(the token ids of its documents back to back, little-endian uint16 when the vocabulary fits,
else uint32; each document as the trainer packs it: BOS, its tokens, EOS) and `<part>.idx`
(little-endian int64: where each document starts in the part, then the part's token count).
The manifest names the format, the dtype, the tokenizer (file name, vocabulary size and sha256)
and each part with its token and document counts, so a truncated or foreign file is refused
before training starts, and token ids are never read with a tokenizer other than the one that
made them. A damaged file is one `error:` line naming it: an index that is not a valid list of
document starts at open, a token id outside the vocabulary when the chunk holding it is read.
"""

from __future__ import annotations

import array
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from torchtitan.errors import DatasetError

MANIFEST = "manifest.json"
FORMAT = "torchtitan-tokens"
VERSION = 1
_DTYPES = {"uint16": (torch.uint16, "H", 2), "uint32": (torch.uint32, "I", 4)}


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class TokenFile:
    tokens: str  # file names inside the folder
    index: str
    num_tokens: int
    num_documents: int


@dataclass(frozen=True)
class TokenizedSource:
    folder: Path
    dtype: str
    vocab_size: int
    tokenizer: str  # the tokenizer file's name when the shards were made
    tokenizer_sha256: str
    files: tuple[TokenFile, ...]

    @property
    def num_tokens(self) -> int:
        return sum(f.num_tokens for f in self.files)

    @classmethod
    def open(cls, folder: Path) -> TokenizedSource:
        """Reads and checks the manifest, the size of every file it names and every document index."""
        path = folder / MANIFEST
        try:
            manifest = json.loads(path.read_text())
            if manifest.get("format") != FORMAT:
                raise DatasetError(f"{path} is not a manifest of pre-tokenized shards (format {manifest.get('format')!r}, "
                                   f"expected {FORMAT!r})")
            if manifest.get("version") != VERSION:
                raise DatasetError(f"{path} has format version {manifest.get('version')}; this torchtitan reads "
                                   f"version {VERSION}: tokenize the data again with scripts/tokenize_dataset.py")
            if manifest["dtype"] not in _DTYPES:
                raise DatasetError(f"{path}: unknown token dtype {manifest['dtype']!r} (uint16 or uint32)")
            files = tuple(TokenFile(str(f["tokens"]), str(f["index"]), int(f["num_tokens"]), int(f["num_documents"]))
                          for f in manifest["files"])
            source = cls(folder, manifest["dtype"], int(manifest["vocab_size"]), str(manifest["tokenizer"]["name"]),
                         str(manifest["tokenizer"]["sha256"]), files)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            if isinstance(e, DatasetError):
                raise
            raise DatasetError(f"{path} is not a readable manifest of pre-tokenized shards ({type(e).__name__}: {e})"
                               ) from None
        if source.vocab_size < 1:
            raise DatasetError(f"{path}: vocab_size {source.vocab_size} is not a vocabulary size (a damaged manifest? "
                               "tokenize the data again)")
        itemsize = _DTYPES[source.dtype][2]
        for f in files:
            if f.num_tokens < 0 or f.num_documents < 0:
                raise DatasetError(f"{path}: {f.tokens} has {f.num_tokens} tokens in {f.num_documents} documents, "
                                   "which cannot be (a damaged manifest? tokenize the data again)")
            for name, expected in ((f.tokens, f.num_tokens * itemsize), (f.index, (f.num_documents + 1) * 8)):
                file = folder / name
                if not file.is_file():
                    raise DatasetError(f"{file} is missing (named by {path})")
                if file.stat().st_size != expected:
                    raise DatasetError(f"{file} holds {file.stat().st_size} bytes, but {path} says {expected} "
                                       "(truncated or rewritten? tokenize the data again)")
            _check_index(folder / f.index, f.num_tokens, path)
        return source

    def check_tokenizer(self, tokenizer, option: str = "model.tokenizer_path") -> None:
        """Refuses a tokenizer other than the one that made the shards (its ids would mean other text)."""
        if tokenizer.n_words != self.vocab_size or tokenizer.fingerprint() != self.tokenizer_sha256:
            raise DatasetError(
                f"{self.folder} was tokenized with {self.tokenizer} (vocabulary {self.vocab_size}, sha256 "
                f"{self.tokenizer_sha256[:12]}), but {option} is {tokenizer.path} (vocabulary {tokenizer.n_words}, "
                f"sha256 {tokenizer.fingerprint()[:12]}); set {option} to the tokenizer that made the shards, or "
                "tokenize the data again")


def _check_index(index: Path, num_tokens: int, manifest: Path) -> None:
    """Refuses an index that is not the document starts of its part: 0 first, never decreasing,
    the part's token count last. The reader slices documents and plans shards (a binary search)
    with it, so a damaged index would otherwise train on wrong slices without a word. Read whole at
    open: 8 bytes per document, under 1% of the token file for documents of 500 tokens or more (the
    0.4 MB index of 48,784 documents is checked in 0.1 ms)."""
    starts = torch.from_file(str(index), shared=False, size=index.stat().st_size // 8, dtype=torch.int64)
    if int(starts[0]) != 0:
        raise DatasetError(f"{index} is damaged: the first document starts at token {int(starts[0])}, not 0 "
                           "(tokenize the data again)")
    back = (starts[1:] < starts[:-1]).nonzero()
    if len(back):
        d = int(back[0])
        raise DatasetError(f"{index} is damaged: document {d + 1} starts at token {int(starts[d + 1])}, before "
                           f"document {d} (token {int(starts[d])}); the starts must never decrease (tokenize the "
                           "data again)")
    if int(starts[-1]) != num_tokens:
        raise DatasetError(f"{index} is damaged: it ends at token {int(starts[-1])}, but {manifest} says the part "
                           f"holds {num_tokens} tokens (tokenize the data again)")


class TokenFiles:
    """The memory-mapped token and index files of one source, opened on first use in the process
    that reads them (a data-loading worker maps its own).

    Token ids are checked against the manifest's vocabulary as they are read (check_ids), not by a
    scan at open, which every rank would pay at every start for the whole source, not only for its
    own shards. Measured on 100 MB of uint16 ids (2026-11-27, 2 shared Xeon cores, one thread): a scan
    takes 0.10 s with torch from the page cache (1.0 GB/s; uint16 has no max(), so via int32) and
    0.14-0.19 s from disk, 57 ms from disk even with numpy (1.7 GB/s; not a dependency), so a 2 TB
    source would cost 20 minutes or more per start. Checking each chunk as it is read adds 38 us per
    256 Ki-token chunk (7 ms per 100 MB, whose reading takes 30 ms); a damaged token is then found
    when its chunk is first read, not before training. The manifest's vocabulary is also the
    model's: the trainer sizes the embedding for the tokenizer's vocabulary
    (preflight.build_model_args), and check_tokenizer refuses shards whose manifest records another
    vocabulary size or tokenizer (a shard made with a larger vocabulary than the model's included)."""

    def __init__(self, source: TokenizedSource):
        self.source = source
        self._maps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, file: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, document starts with the token count appended) of file number `file`."""
        if file not in self._maps:
            f = self.source.files[file]
            dtype = _DTYPES[self.source.dtype][0]
            tokens = torch.from_file(str(self.source.folder / f.tokens), shared=False, size=f.num_tokens, dtype=dtype)
            starts = torch.from_file(str(self.source.folder / f.index), shared=False, size=f.num_documents + 1,
                                     dtype=torch.int64)
            self._maps[file] = (tokens, starts)
        return self._maps[file]

    def check_ids(self, file: int, ids: torch.Tensor, pieces: list[tuple[int, int]]) -> None:
        """Refuses ids outside the vocabulary (a damaged token file), which would otherwise end the
        run in the embedding with an IndexError. `ids` (int32) are the pieces (first token, length)
        of file number `file`, back to back."""
        vocab = self.source.vocab_size
        if not ids.numel():
            return
        low, high = torch.aminmax(ids)
        if int(low) >= 0 and int(high) < vocab:
            return
        i = int(((ids < 0) | (ids >= vocab)).nonzero()[0])
        value = int(ids[i]) & 0xFFFFFFFF  # a uint32 id above 2**31 - 1 reads as negative in int32
        position = i
        for at, length in pieces:  # the index into `ids` -> the token's place in its file
            if i < length:
                position = at + i
                break
            i -= length
        path = self.source.folder / self.source.files[file].tokens
        raise DatasetError(f"{path}: token id {value} at token {position} is outside the vocabulary of "
                           f"{vocab} that {MANIFEST} records (a damaged file? tokenize the data again)")


class TokenFileWriter:
    """Writes one part: documents' token ids appended one at a time, the index at close."""

    def __init__(self, folder: Path, name: str, dtype: str, vocab_size: int):
        self.folder, self.name, self.dtype, self.vocab_size = folder, name, dtype, vocab_size
        self._code = _DTYPES[dtype][1]
        self._tmp = folder / f"{name}.bin.tmp"
        self._file = self._tmp.open("wb")
        self._starts = array.array("q", [0])

    def add(self, ids: list[int]) -> None:
        # The reader refuses ids outside the manifest's vocabulary as damage; a tokenizer that emits
        # one is refused here instead, where the tokenizer is the cause (token_dtype fits the vocabulary).
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise DatasetError(f"the tokenizer gave token id {bad}, outside its vocabulary of {self.vocab_size}")
        values = array.array(self._code, ids)
        if sys.byteorder != "little":
            values.byteswap()
        self._file.write(values.tobytes())
        self._starts.append(self._starts[-1] + len(ids))

    def close(self) -> TokenFile:
        self._file.close()
        starts = self._starts
        if sys.byteorder != "little":
            starts = array.array("q", starts)
            starts.byteswap()
        index = self.folder / f"{self.name}.idx"
        index.write_bytes(starts.tobytes())
        os.replace(self._tmp, self.folder / f"{self.name}.bin")
        return TokenFile(f"{self.name}.bin", index.name, self._starts[-1], len(self._starts) - 1)


def write_manifest(folder: Path, files: list[TokenFile], dtype: str, tokenizer, source: str) -> Path:
    """The manifest, written last (and atomically): a folder without one is not a tokenized source."""
    manifest = {
        "format": FORMAT, "version": VERSION, "dtype": dtype, "vocab_size": tokenizer.n_words,
        "tokenizer": {"name": os.path.basename(tokenizer.path), "sha256": tokenizer.fingerprint()},
        "bos": tokenizer.bos_id, "eos": tokenizer.eos_id, "source": source,
        "num_tokens": sum(f.num_tokens for f in files), "num_documents": sum(f.num_documents for f in files),
        "files": [{"tokens": f.tokens, "index": f.index, "num_tokens": f.num_tokens, "num_documents": f.num_documents}
                  for f in files],
    }
    tmp = folder / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, folder / MANIFEST)
    return folder / MANIFEST
