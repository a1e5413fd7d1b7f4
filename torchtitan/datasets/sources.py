"""Text sources: where documents come from (registered names, local files, pre-tokenized shards,
optional HF streaming), and the readers that take one piece of a file at a time.

Local files: JSON lines (`text` field), plain text (one document per file), Parquet (`text` column,
needs pyarrow), folders of pre-tokenized shards (tokenized.py) and gzip-compressed JSON lines (a
stream: read in order, streams.py), given as a file, a folder or a glob. Which pieces a data shard
reads is decided in chunks.py (streams.py for streams); packing happens in text_dataset.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import gzip
import json
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from torchtitan.assets import resolve_path
from torchtitan.datasets.tokenized import MANIFEST, TokenizedSource
from torchtitan.errors import DatasetError

__all__ = ["DatasetError", "resolve_source", "read_documents"]

logger = logging.getLogger(__name__)

SUPPORTED_SUFFIXES = (".jsonl", ".txt", ".parquet")
STREAM_SUFFIXES = (".jsonl.gz", ".json.gz")  # gzip-compressed JSON lines: streams (streams.py)


@dataclass(frozen=True)
class HFSource:
    """A Hugging Face hub dataset streamed with the optional `datasets` package."""

    path: str
    name: str | None = None
    split: str = "train"
    text_field: str = "text"
    option: str = "training"  # the config section that named it, for the error lines


@dataclass(frozen=True)
class GzipFiles:
    """Gzip-compressed JSON-lines files (C4's format). A gzip file cannot be entered at a byte
    offset, so these are streams: each file is one stream shard, read from its start (streams.py)."""

    files: tuple[Path, ...]


# Registered sources: short name -> local path (`bundled:` for a file the package ships) or hub dataset.
DATASETS: dict[str, str | HFSource] = {
    # Docstrings of Python's standard library, about 1 MB (torchtitan/assets/stdlib_docs/README.md).
    "stdlib_docs": "bundled:stdlib_docs/corpus.jsonl",
    # 2,000 synthetic conversations, each asking to reverse a few words (sft.format chat; torchtitan/assets/reverse_words).
    "reverse_words": "bundled:reverse_words/train.jsonl",
    # English C4, streamed: needs `pip install datasets` and network access.
    "c4": HFSource("allenai/c4", "en"),
}


@dataclass
class BadLineCounter:
    """With skip_bad_lines, malformed lines are counted and skipped instead of stopping the run."""

    skip_bad_lines: bool = False
    skipped: int = 0

    def bad(self, where: str, why: str) -> None:
        if not self.skip_bad_lines:
            raise DatasetError(f"{where}: {why} (set training.dataset_skip_bad_lines to skip such lines)")
        self.skipped += 1
        if self.skipped == 1 or self.skipped % 1000 == 0:
            logger.warning(f"skipped {self.skipped} bad line(s) so far; latest {where}: {why}")


def resolve_source(name: str, dataset_path: str, option: str = "training"):
    """The files (sorted), pre-tokenized shards or hub dataset that <option>.dataset / dataset_path
    name (`option` is the config section: training, or validation for its own data)."""
    if not dataset_path:
        if name not in DATASETS:
            raise DatasetError(f"unknown {option}.dataset {name!r}; known: {', '.join(sorted(DATASETS))} "
                               f"(or set {option}.dataset_path to local files)")
        source = DATASETS[name]
        if isinstance(source, HFSource):
            return dataclasses.replace(source, option=option)
        return local_source(resolve_path(source, f"{option}.dataset {name!r}", DatasetError))
    return local_source(resolve_path(dataset_path, f"{option}.dataset_path", DatasetError))


def local_source(dataset_path: str):
    """A folder of pre-tokenized shards (it holds their manifest), else the supported text files."""
    path = Path(dataset_path)
    if path.name == MANIFEST and path.is_file():
        return TokenizedSource.open(path.parent)
    if path.is_dir() and (path / MANIFEST).is_file():
        return TokenizedSource.open(path)
    return _local_files(dataset_path)


def _local_files(dataset_path: str) -> list[Path] | GzipFiles:
    path = Path(dataset_path)
    if any(c in dataset_path for c in "*?["):
        found = sorted(Path(p) for p in glob.glob(dataset_path, recursive=True))
    elif path.is_dir():
        found = sorted(path.rglob("*"))
    elif path.is_file() or path.is_symlink():
        found = [path]
    else:
        raise DatasetError(f"dataset file not found: {dataset_path}")
    _refuse_broken_links(found)
    files = [p for p in found if p.is_file()]
    streams = [f for f in files if f.name.endswith(STREAM_SUFFIXES)]
    files = [f for f in files if f.suffix in SUPPORTED_SUFFIXES]
    if streams and files:
        raise DatasetError(f"{dataset_path} holds both gzip-compressed streams ({streams[0].name}) and other files "
                           f"({files[0].name}), which are split differently; give them as two sources of training.dataset_mix")
    if streams:
        return GzipFiles(tuple(streams))
    if not files:
        raise DatasetError(f"no {', '.join(SUPPORTED_SUFFIXES + STREAM_SUFFIXES)} files in {dataset_path} (nor a "
                           "folder of pre-tokenized shards: scripts/tokenize_dataset.py)")
    return files


def _refuse_broken_links(paths: list[Path]) -> None:
    """A link to data whose target is gone (an unmounted disk, a moved file) would otherwise be skipped
    silently, and the run would train on less data than asked, or find "no files" at all."""
    for p in paths:
        if p.is_symlink() and not p.exists() and (p.suffix in SUPPORTED_SUFFIXES or p.name.endswith(STREAM_SUFFIXES)):
            raise DatasetError(f"{p} is a broken symbolic link (to {os.readlink(p)}, which does not exist); point it at "
                               "the data or remove it")


def read_documents(source, counter: BadLineCounter | None = None) -> Iterator[str]:
    """All documents of a text source, in its fixed order (files sorted by path); for tools and
    tests. Training reads its shards' pieces instead (chunks.py)."""
    counter = counter or BadLineCounter()
    if isinstance(source, HFSource):
        yield from read_hf(source)
        return
    if isinstance(source, GzipFiles):
        for path in source.files:
            for number, line in enumerate(read_gzip_lines(path, 0)):
                text = json_text(line, counter, path, number + 1)
                if text is not None:
                    yield text
        return
    for path in [source] if isinstance(source, Path) else source:
        if path.suffix == ".jsonl":
            for text, _ in read_jsonl(path, 0, path.stat().st_size, counter):
                yield text
        elif path.suffix == ".parquet":
            table = open_parquet(path)
            for group in range(table.metadata.num_row_groups):
                for text, _ in read_parquet(table, group):
                    yield text
        else:
            text = read_text_file(path, counter)
            if text:
                yield text


class ByteCount:
    """Bytes taken from the operating system by the readers of one chunk (read amplification)."""

    def __init__(self) -> None:
        self.bytes = 0


def read_jsonl(path: Path, begin: int, end: int, counter: BadLineCounter,
               read: ByteCount | None = None, parse: Callable[[Any], Any] | None = None) -> Iterator[tuple[Any, int]]:
    """The documents of the lines of a JSON-lines file that START at a byte in [begin, end), each
    with its start byte: a line crossing `end` is read whole by this range and skipped by the next,
    so ranges that tile a file give each line to exactly one of them. Reads the range and the rest
    of its last line, nothing more. A document is the line's `text`; with `parse`, what `parse`
    makes of the whole JSON value (a ValueError from it is a bad line, its message the reason)."""
    first = max(begin - 1, 0)
    with path.open("rb", buffering=0) as f:
        f.seek(first)
        data = _read_up_to(f, end - first)
        # The line holding byte begin - 1 belongs to an earlier range; a line starting exactly at
        # `begin` (byte begin - 1 is its predecessor's newline) is ours.
        at = 0 if begin == 0 else data.find(b"\n") + 1
        if at == 0 and begin > 0:  # no line starts in this range (it lies inside one long line)
            data = b""
        elif len(data) == end - first and not data.endswith(b"\n"):
            data += _rest_of_line(f, min(max((end - first) // 64, 64), 4096))
        if read is not None:
            read.bytes += f.tell() - first
    lines = data[at:].split(b"\n")
    start = first + at
    for line in lines:
        if start >= end or start >= first + len(data):
            break
        line_start, start = start, start + len(line) + 1
        if not line.strip():
            continue
        if parse is not None:
            try:
                yield parse(json.loads(line.decode("utf-8"))), line_start
            except UnicodeDecodeError as e:
                counter.bad(where(path, line_start), f"invalid UTF-8 at byte {e.start} of the line")
            except json.JSONDecodeError:
                counter.bad(where(path, line_start), "not valid JSON")
            except ValueError as e:
                counter.bad(where(path, line_start), str(e))
            continue
        try:
            text = json.loads(line.decode("utf-8"))["text"]
        except UnicodeDecodeError as e:
            counter.bad(where(path, line_start), f"invalid UTF-8 at byte {e.start} of the line")
            continue
        except (json.JSONDecodeError, KeyError, TypeError):
            counter.bad(where(path, line_start), "not a JSON object with a 'text' field")
            continue
        if not isinstance(text, str):
            counter.bad(where(path, line_start), f"'text' holds {type(text).__name__} {str(text)[:40]!r}, not a string")
            continue
        yield text, line_start


def _read_up_to(f, size: int) -> bytes:
    parts = []
    while size > 0:
        block = f.read(size)
        if not block:
            break
        parts.append(block)
        size -= len(block)
    return b"".join(parts)


def _rest_of_line(f, block_size: int) -> bytes:
    """From the file's position through the next newline (or the end), in growing blocks."""
    parts = []
    while True:
        block = f.read(block_size)
        if not block:
            break
        newline = block.find(b"\n")
        if newline >= 0:
            parts.append(block[:newline + 1])
            break
        parts.append(block)
        block_size = min(block_size * 2, 1 << 20)
    return b"".join(parts)


def where(path: Path, start: int) -> str:
    """`path:line` for the line starting at byte `start`: counted only for a line that is reported."""
    lines = 1
    with path.open("rb") as f:
        remaining = start
        while remaining > 0:
            block = f.read(min(remaining, 1 << 20))
            if not block:
                break
            lines += block.count(b"\n")
            remaining -= len(block)
    return f"{path}:{lines}"


def read_text_file(path: Path, counter: BadLineCounter, read: ByteCount | None = None) -> str:
    """A plain-text file: one document (empty when the file holds only whitespace)."""
    data = path.read_bytes()
    if read is not None:
        read.bytes += len(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        counter.bad(f"{path}", f"invalid UTF-8 at byte {e.start}")
        text = data.decode("utf-8", errors="replace")
    return text if text.strip() else ""


def open_parquet(path: Path, read: ByteCount | None = None):
    """A Parquet file with its footer read (counted in `read`); checked to have a string `text` column."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"reading {path} needs pyarrow, which is not installed: pip install pyarrow") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own error kinds for a file that is not Parquet
        raise DatasetError(f"{path} is not a readable Parquet file: {e}") from None
    if read is not None:
        read.bytes += table.metadata.serialized_size + 8  # the footer, its length and the magic number
    if "text" not in table.schema_arrow.names:
        raise DatasetError(f"{path} has no 'text' column (columns: {', '.join(table.schema_arrow.names)})")
    kind = table.schema_arrow.field("text").type
    if str(kind) not in ("string", "large_string", "string_view"):
        raise DatasetError(f"{path}: the 'text' column holds {kind}, not strings")
    return table


def parquet_row_groups(table) -> list[tuple[int, int]]:
    """(start byte in the file, rows) of each row group of an open Parquet file, from its footer."""
    metadata = table.metadata
    groups = []
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        starts = []
        for c in range(group.num_columns):
            column = group.column(c)
            starts += [o for o in (column.dictionary_page_offset, column.data_page_offset) if o]
        groups.append((min(starts) if starts else 0, group.num_rows))
    return groups


def read_parquet(table, group: int, read: ByteCount | None = None) -> Iterator[tuple[str, int]]:
    """The non-empty `text` values of one row group of an open Parquet file, each with its row
    number in the file; only that row group's `text` column chunk is read."""
    metadata = table.metadata
    first_row = sum(metadata.row_group(g).num_rows for g in range(group))
    column = table.schema_arrow.names.index("text")
    if read is not None:
        read.bytes += metadata.row_group(group).column(column).total_compressed_size
    values = table.read_row_group(group, columns=["text"]).column(0).to_pylist()
    for row, text in enumerate(values, start=first_row):
        if text:
            yield text, row


def hub_dataset(source: HFSource):
    """The hub dataset as a `datasets` IterableDataset (streamed: rows are fetched as they are read)."""
    try:
        import datasets
    except ImportError:
        raise DatasetError(
            f"dataset {source.path} streams from the Hugging Face hub and needs the optional `datasets` "
            f"package (pip install datasets) plus network access; or set {source.option}.dataset_path to local files"
        ) from None
    with hub_errors(source):
        return datasets.load_dataset(source.path, source.name, split=source.split, streaming=True)


@contextlib.contextmanager
def hub_errors(source: HFSource) -> Iterator[None]:
    """The network gone (at the start or mid-stream) as one line naming the dataset."""
    try:
        yield
    except (ConnectionError, OSError) as e:
        raise DatasetError(f"cannot stream {source.path} from the Hugging Face hub (offline?): {e}") from None


def read_hf(source: HFSource) -> Iterator[str]:
    with hub_errors(source):
        for row in hub_dataset(source):
            yield row[source.text_field]


def read_gzip_lines(path: Path, skip: int, read: ByteCount | None = None) -> Iterator[bytes]:
    """The lines of a gzip-compressed file from line number `skip` on. gzip cannot be entered in
    the middle: the lines before `skip` are decompressed and counted, not parsed. `read` counts
    the compressed bytes taken from the file."""
    counted = 0
    try:
        with path.open("rb") as raw, gzip.GzipFile(fileobj=raw) as f:
            for number, line in enumerate(f):
                if number >= skip:
                    if read is not None:
                        read.bytes, counted = read.bytes + raw.tell() - counted, raw.tell()
                    yield line
            if read is not None:
                read.bytes += raw.tell() - counted
    except (OSError, EOFError, zlib.error) as e:  # gzip's errors: not gzip, truncated, damaged; or the file gone
        raise DatasetError(f"{path} is not a readable gzip file ({e}); re-download or re-compress it") from None


def json_text(line: bytes, counter: BadLineCounter, path: Path, line_number: int) -> str | None:
    """The `text` of one JSON line (line `line_number` of `path`, counted from 1, for the error
    lines); None for a blank line or a bad one that `counter` skips."""
    if not line.strip():
        return None
    try:
        text = json.loads(line.decode("utf-8"))["text"]
    except UnicodeDecodeError as e:
        counter.bad(f"{path}:{line_number}", f"invalid UTF-8 at byte {e.start} of the line")
        return None
    except (json.JSONDecodeError, KeyError, TypeError):
        counter.bad(f"{path}:{line_number}", "not a JSON object with a 'text' field")
        return None
    if not isinstance(text, str):
        counter.bad(f"{path}:{line_number}", f"'text' holds {type(text).__name__} {str(text)[:40]!r}, not a string")
        return None
    return text
