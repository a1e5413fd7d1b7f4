"""Turns a text source into pre-tokenized shards (tokenized.py), on every core.

The source is cut into `parts` with the trainer's own shard plan (chunks.py), so part p holds the
documents data shard p of `parts` would read, in the same order, tokenized as the trainer
tokenizes them (BOS ... EOS). The parts laid end to end are therefore exactly the token stream of
the text, and a run over the shards with one data shard sees the batches a run over the text does.
Worker processes each write whole parts; the manifest is written last, so an interrupted run
leaves no folder that looks complete, and a run that fails (a bad line, a full disk) removes the
parts it wrote.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

from torchtitan.datasets.chunks import ShardItems
from torchtitan.datasets.sources import DatasetError, GzipFiles, HFSource
from torchtitan.datasets.tokenized import MANIFEST, TokenFile, TokenFileWriter, TokenizedSource, token_dtype, write_manifest

PART_BYTES = 512 << 20  # default size of a part, in source bytes

# The worker processes' view of the job, set once per worker by _start_worker.
_job: dict[str, Any] = {}


def source_bytes(source: Any) -> int:
    if isinstance(source, TokenizedSource):
        raise DatasetError(f"{source.folder} is already a folder of token shards; give --input the text they came from")
    if isinstance(source, HFSource):
        raise DatasetError(f"{source.path} is a hub stream; tokenize_dataset reads local files (.jsonl, .txt, .parquet)")
    if isinstance(source, GzipFiles):
        raise DatasetError(f"{source.files[0]} is gzip-compressed (a stream, read by the trainer as it is); "
                           "tokenize_dataset reads .jsonl, .txt and .parquet: gunzip the files first")
    return sum(f.stat().st_size for f in source)


def _start_worker(job: dict[str, Any]) -> None:
    _job.update(job)


def _tokenize_part(part: int) -> tuple[TokenFile, int]:
    job = _job
    items = ShardItems(job["source"], part, job["parts"], job["tokenizer"], infinite=False,
                       skip_bad_lines=job["skip_bad_lines"], lengths=True)
    writer = TokenFileWriter(job["out"], f"part-{part:05d}", job["dtype"], job["tokenizer"].n_words)
    for item in items.items():
        if "error" in item:  # a bad line: this script's option skips it, not the trainer's
            raise DatasetError(item["error"].replace("training.dataset_skip_bad_lines", "--skip-bad-lines"))
        ids, at = item["tokens"].tolist(), 0
        for length in item["lengths"]:
            writer.add(ids[at:at + length])
            at += length
        with job["bytes"].get_lock():
            job["bytes"].value += item["bytes"]
        with job["tokens"].get_lock():
            job["tokens"].value += len(ids)
    return writer.close(), items.counter.skipped


def pretokenize(source: Any, tokenizer: Any, out: Path, workers: int, parts: int = 0, skip_bad_lines: bool = False,
                overwrite: bool = False, progress: bool = True, description: str = "") -> tuple[Path, dict[str, float]]:
    """Writes the shards and their manifest into `out`; returns the manifest's path and figures
    (documents, tokens, seconds, tokens per second, skipped lines)."""
    total = source_bytes(source)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST).exists() and not overwrite:
        raise DatasetError(f"{out} already holds tokenized shards ({MANIFEST}); choose another folder or pass --overwrite")
    (out / MANIFEST).unlink(missing_ok=True)
    _remove_parts(out)
    parts = parts or max(workers, -(-total // PART_BYTES))
    context = multiprocessing.get_context("fork")  # the workers inherit the source and tokenizer
    job = {"source": source, "parts": parts, "tokenizer": tokenizer, "skip_bad_lines": skip_bad_lines, "out": out,
           "dtype": token_dtype(tokenizer.n_words), "bytes": context.Value("q", 0), "tokens": context.Value("q", 0)}
    start, drawn = time.perf_counter(), False
    try:
        with context.Pool(min(workers, parts), initializer=_start_worker, initargs=(job,)) as pool:
            pending = pool.map_async(_tokenize_part, range(parts), chunksize=1)
            while not pending.ready():
                pending.wait(0.5)
                if progress:
                    _show(job["bytes"].value, total, job["tokens"].value, time.perf_counter() - start)
                    drawn = True
            results = pending.get()  # raises a worker's error here
        seconds = time.perf_counter() - start
        if progress:
            _show(total, total, job["tokens"].value, seconds, finished=True)
        files = [f for f, _ in results]
        manifest = write_manifest(out, files, job["dtype"], tokenizer, description or str(source))
    except BaseException:
        if drawn and sys.stderr.isatty():  # end the bar redrawn in place: the error gets a line of its own
            sys.stderr.write("\n")
        # A bad line, a full disk, Ctrl-C: the parts written so far are no use without a manifest
        # (and may be what filled the disk), so the folder is left as the run found it.
        _remove_parts(out)
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    tokens = sum(f.num_tokens for f in files)
    return manifest, {"documents": sum(f.num_documents for f in files), "tokens": tokens, "seconds": seconds,
                      "tokens_per_second": tokens / seconds, "skipped": sum(s for _, s in results), "parts": parts}


def _remove_parts(out: Path) -> None:
    """The part files of a run (finished, interrupted or half written), and no other file."""
    for pattern in ("part-[0-9][0-9][0-9][0-9][0-9].bin", "part-[0-9][0-9][0-9][0-9][0-9].idx",
                    "part-[0-9][0-9][0-9][0-9][0-9].bin.tmp"):
        for part in out.glob(pattern):
            part.unlink(missing_ok=True)


def _show(done: int, total: int, tokens: int, seconds: float, finished: bool = False, width: int = 30) -> None:
    """A progress bar on stderr: redrawn in place on a terminal, a line every 10 s in a log."""
    done = min(done, total)  # a range's last line is read past its end
    share = done / total if total else 1.0
    bar = "#" * int(width * share) + "." * (width - int(width * share))
    rate = done / seconds if seconds else 0.0
    eta = f"eta {(total - done) / rate:5.0f} s" if rate and not finished else "done" if finished else ""
    unit, scale = ("GB", 1e9) if total >= 1e9 else ("MB", 1e6)
    line = (f"[{bar}] {100 * share:5.1f}%  {done / scale:.2f}/{total / scale:.2f} {unit}  {rate / 1e6:6.1f} MB/s  "
            f"{tokens / seconds / 1e6 if seconds else 0:5.2f} M tokens/s  {eta}")
    terminal = sys.stderr.isatty()
    if terminal or finished or seconds % 10 < 0.5:
        sys.stderr.write(("\r" if terminal else "") + line + ("\n" if finished or not terminal else ""))
        sys.stderr.flush()
