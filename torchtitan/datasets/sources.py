"""Text sources: where documents come from (registered names, local files, optional HF streaming).

A source is read as one ordered stream of document strings; sharding and packing happen later,
in text_dataset.py. Local files: JSON lines (`text` field), plain text (one document per file)
and Parquet (`text` column, needs pyarrow), given as a file, a folder or a glob.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from torchtitan.assets import resolve_path
from torchtitan.errors import UserError

logger = logging.getLogger(__name__)

SUPPORTED_SUFFIXES = (".jsonl", ".txt", ".parquet")


class DatasetError(UserError, ValueError):
    """A dataset name, file or line the user can fix; the message names it."""


@dataclass(frozen=True)
class HFSource:
    """A Hugging Face hub dataset streamed with the optional `datasets` package."""

    path: str
    name: str | None = None
    split: str = "train"
    text_field: str = "text"
    option: str = "training"  # the config section that named it, for the error lines


# Registered sources: short name -> local path (`bundled:` for a file the package ships) or hub dataset.
DATASETS: dict[str, str | HFSource] = {
    # Docstrings of Python's standard library, about 1 MB (torchtitan/assets/stdlib_docs/README.md).
    "stdlib_docs": "bundled:stdlib_docs/corpus.jsonl",
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


def resolve_source(name: str, dataset_path: str, option: str = "training") -> list[Path] | HFSource:
    """The files (sorted) or hub dataset that <option>.dataset / <option>.dataset_path name
    (`option` is the config section: training, or validation for its own data)."""
    if not dataset_path:
        if name not in DATASETS:
            raise DatasetError(f"unknown {option}.dataset {name!r}; known: {', '.join(sorted(DATASETS))} "
                               f"(or set {option}.dataset_path to local files)")
        source = DATASETS[name]
        if isinstance(source, HFSource):
            return dataclasses.replace(source, option=option)
        return _local_files(resolve_path(source, f"{option}.dataset {name!r}", DatasetError))
    return _local_files(resolve_path(dataset_path, f"{option}.dataset_path", DatasetError))


def _local_files(dataset_path: str) -> list[Path]:
    path = Path(dataset_path)
    if any(c in dataset_path for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(dataset_path, recursive=True) if Path(p).is_file())
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
    elif path.is_file():
        files = [path]
    else:
        raise DatasetError(f"dataset file not found: {dataset_path}")
    files = [f for f in files if f.suffix in SUPPORTED_SUFFIXES]
    if not files:
        raise DatasetError(f"no {', '.join(SUPPORTED_SUFFIXES)} files in {dataset_path}")
    return files


@dataclass(frozen=True)
class StreamPosition:
    """A point between two documents of a source's stream: `index` documents come before it.

    For local files it also says where reading continues, so that a resumed run seeks there rather
    than reading everything before it again: file number `file` of the sorted list (named `name`),
    at byte `offset` of a JSON-lines file (whose next line is number `line`), or row `offset` of a
    Parquet file; a plain-text file is one document, and offset 1 means it was read. A hub stream
    has no such place and is resumed by skipping `index` documents.
    """

    index: int = 0
    file: int = 0
    offset: int = 0
    line: int = 1
    name: str = ""

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index, "file": self.file, "offset": self.offset, "line": self.line, "name": self.name}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> StreamPosition:
        return cls(int(state["index"]), int(state["file"]), int(state["offset"]), int(state["line"]), str(state["name"]))


def read_documents(source: Path | list[Path] | HFSource, counter: BadLineCounter | None = None) -> Iterator[str]:
    """All documents of a source, in a fixed order (files sorted by path)."""
    for doc, _ in read_from(source, counter):
        yield doc


def read_from(source: Path | list[Path] | HFSource, counter: BadLineCounter | None = None,
              start: StreamPosition | None = None) -> Iterator[tuple[str, StreamPosition]]:
    """The documents after `start` (default: all), each with the position just after it."""
    counter = counter or BadLineCounter()
    start = start or StreamPosition()
    if isinstance(source, HFSource):
        for i, doc in enumerate(_read_hf(source)):  # a stream cannot seek: skip by count
            if i >= start.index:
                yield doc, StreamPosition(index=i + 1)
        return
    files = [source] if isinstance(source, Path) else source
    if start.index and not _can_seek(files, start):
        logger.warning(f"the dataset's files changed since this data position was saved (file {start.file} was "
                       f"{start.name!r}); finding the position by counting {start.index} documents instead")
        for doc, position in read_from(source, counter):
            if position.index > start.index:
                yield doc, position
        return
    index = start.index
    for n in range(start.file, len(files)):
        path = files[n]
        begin = (start.offset, start.line) if n == start.file else (0, 1)
        for doc, offset, line in _READERS.get(path.suffix, _read_text)(path, counter, *begin):
            index += 1
            yield doc, StreamPosition(index, n, offset, line, path.name)


def _can_seek(files: list[Path], start: StreamPosition) -> bool:
    """Whether `start` still points between two documents of the same file."""
    if start.file >= len(files) or files[start.file].name != start.name:
        return False
    path = files[start.file]
    if path.suffix != ".jsonl" or start.offset == 0:
        return True
    if start.offset > path.stat().st_size:
        return False
    with path.open("rb") as f:  # a line must end right before the offset
        f.seek(start.offset - 1)
        return f.read(1) == b"\n"


def _read_jsonl(path: Path, counter: BadLineCounter, offset: int, line_no: int) -> Iterator[tuple[str, int, int]]:
    with path.open("rb") as f:
        f.seek(offset)
        for raw in f:
            offset, line_no = offset + len(raw), line_no + 1
            if not raw.strip():
                continue
            where = f"{path}:{line_no - 1}"
            try:
                text = json.loads(raw.decode("utf-8"))["text"]
            except UnicodeDecodeError as e:
                counter.bad(where, f"invalid UTF-8 at byte {e.start} of the line")
                continue
            except (json.JSONDecodeError, KeyError, TypeError):
                counter.bad(where, "not a JSON object with a 'text' field")
                continue
            if not isinstance(text, str):
                counter.bad(where, f"'text' holds {type(text).__name__} {str(text)[:40]!r}, not a string")
                continue
            yield text, offset, line_no


def _read_text(path: Path, counter: BadLineCounter, offset: int, line_no: int) -> Iterator[tuple[str, int, int]]:
    if offset:  # already read
        return
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        counter.bad(f"{path}", f"invalid UTF-8 at byte {e.start}")
        text = data.decode("utf-8", errors="replace")
    if text.strip():
        yield text, 1, 1


def _read_parquet(path: Path, counter: BadLineCounter, row: int, line_no: int) -> Iterator[tuple[str, int, int]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"reading {path} needs pyarrow, which is not installed: pip install pyarrow") from None
    table = pq.ParquetFile(path)
    if "text" not in table.schema_arrow.names:
        raise DatasetError(f"{path} has no 'text' column (columns: {', '.join(table.schema_arrow.names)})")
    # Whole row groups before `row` are never read; within the first one, rows before it are dropped.
    first, before = 0, 0
    while first < table.num_row_groups and before + table.metadata.row_group(first).num_rows <= row:
        before += table.metadata.row_group(first).num_rows
        first += 1
    groups = list(range(first, table.num_row_groups))
    if not groups:
        return
    for batch in table.iter_batches(columns=["text"], row_groups=groups):
        for text in batch.column(0).to_pylist():
            before += 1
            if before > row and text:
                yield text, before, 1


_READERS = {".jsonl": _read_jsonl, ".parquet": _read_parquet}


def _read_hf(source: HFSource) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise DatasetError(
            f"dataset {source.path} streams from the Hugging Face hub and needs the optional `datasets` "
            f"package (pip install datasets) plus network access; or set {source.option}.dataset_path to local files"
        ) from None
    try:
        stream = datasets.load_dataset(source.path, source.name, split=source.split, streaming=True)
        for row in stream:
            yield row[source.text_field]
    except (ConnectionError, OSError) as e:
        raise DatasetError(f"cannot stream {source.path} from the Hugging Face hub (offline?): {e}") from None
