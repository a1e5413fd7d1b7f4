"""Text sources: where documents come from (registered names, local files, optional HF streaming).

A source is read as one ordered stream of document strings; sharding and packing happen later,
in text_dataset.py. Local files: JSON lines (`text` field), plain text (one document per file)
and Parquet (`text` column, needs pyarrow), given as a file, a folder or a glob.
"""

from __future__ import annotations

import glob
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
SUPPORTED_SUFFIXES = (".jsonl", ".txt", ".parquet")


class DatasetError(ValueError):
    """A dataset name, file or line the user can fix; the message names it."""


@dataclass(frozen=True)
class HFSource:
    """A Hugging Face hub dataset streamed with the optional `datasets` package."""

    path: str
    name: str | None = None
    split: str = "train"
    text_field: str = "text"


# Registered sources: short name -> local path (relative to the repository root) or hub dataset.
DATASETS: dict[str, str | HFSource] = {
    # Docstrings of Python's standard library, about 1 MB (tests/assets/stdlib_docs/README.md).
    "stdlib_docs": "tests/assets/stdlib_docs/corpus.jsonl",
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


def resolve_source(name: str, dataset_path: str) -> list[Path] | HFSource:
    """The files (sorted) or hub dataset that training.dataset / training.dataset_path name."""
    if not dataset_path:
        if name not in DATASETS:
            raise DatasetError(f"unknown training.dataset {name!r}; known: {', '.join(sorted(DATASETS))} "
                               "(or set training.dataset_path to local files)")
        source = DATASETS[name]
        if isinstance(source, HFSource):
            return source
        dataset_path = str(REPO_ROOT / source)
    return _local_files(dataset_path)


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


def read_documents(source: Path | list[Path] | HFSource, counter: BadLineCounter | None = None) -> Iterator[str]:
    """All documents of a source, in a fixed order (files sorted by path)."""
    counter = counter or BadLineCounter()
    if isinstance(source, HFSource):
        yield from _read_hf(source)
        return
    for path in [source] if isinstance(source, Path) else source:
        if path.suffix == ".jsonl":
            yield from _read_jsonl(path, counter)
        elif path.suffix == ".parquet":
            yield from _read_parquet(path)
        else:
            yield from _read_text(path, counter)


def _read_jsonl(path: Path, counter: BadLineCounter) -> Iterator[str]:
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                text = json.loads(raw.decode("utf-8"))["text"]
            except UnicodeDecodeError as e:
                counter.bad(f"{path}:{line_no}", f"invalid UTF-8 at byte {e.start} of the line")
                continue
            except (json.JSONDecodeError, KeyError, TypeError):
                counter.bad(f"{path}:{line_no}", "not a JSON object with a 'text' field")
                continue
            if not isinstance(text, str):
                counter.bad(f"{path}:{line_no}", f"'text' is a {type(text).__name__}, not a string")
                continue
            yield text


def _read_text(path: Path, counter: BadLineCounter) -> Iterator[str]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        counter.bad(f"{path}", f"invalid UTF-8 at byte {e.start}")
        text = data.decode("utf-8", errors="replace")
    if text.strip():
        yield text


def _read_parquet(path: Path) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"reading {path} needs pyarrow, which is not installed: pip install pyarrow") from None
    table = pq.ParquetFile(path)
    if "text" not in table.schema_arrow.names:
        raise DatasetError(f"{path} has no 'text' column (columns: {', '.join(table.schema_arrow.names)})")
    for batch in table.iter_batches(columns=["text"]):
        yield from (t for t in batch.column(0).to_pylist() if t)


def _read_hf(source: HFSource) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise DatasetError(
            f"dataset {source.path} streams from the Hugging Face hub and needs the optional `datasets` "
            "package (pip install datasets) plus network access; or set training.dataset_path to local files"
        ) from None
    try:
        stream = datasets.load_dataset(source.path, source.name, split=source.split, streaming=True)
        for row in stream:
            yield row[source.text_field]
    except (ConnectionError, OSError) as e:
        raise DatasetError(f"cannot stream {source.path} from the Hugging Face hub (offline?): {e}") from None
