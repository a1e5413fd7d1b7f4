"""The files a run's metrics go to on disk, metrics.jsonl and TensorBoard's event files, written so that
a full or read-only disk stops the file (one warning line) and never the run.

Why a failed write does not stop training: the step lines still reach the console, the figures of a
run can be recomputed, and every rank trains on, so the next checkpoint is still attempted; it has
its own free-space check and ends the run with exit code 4 if the disk is still full, keeping every
earlier checkpoint. Stopping here instead would lose the steps since the last checkpoint over a log
file, and only the writing rank would stop (the others would wait for it in a collective).
docs/operations.md, "A full disk", says the same to users.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import time
from typing import IO, Any, Callable

logger = logging.getLogger(__name__)


def _reason(exc: OSError, path: str) -> str:
    """`No space left on device, 0.1 MiB free on the disk holding /x`, or the error's own text."""
    text = exc.strerror or str(exc) or type(exc).__name__
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        folder = os.path.dirname(os.path.abspath(path))
        try:
            text += f", {shutil.disk_usage(folder).free / 2**20:,.1f} MiB free on the disk holding {folder}"
        except OSError:
            pass
    return text


class MetricsFile:
    """One file the metrics go to. A write that fails stops this file for the rest of the run with
    one warning line naming it, the step and the cause (`stopped` keeps them for the run's summary)."""

    what = ""  # the kind of file, for the warning

    def __init__(self, path: str):
        self.path = path
        self.stopped: str | None = None  # "at step N: <cause>" once a write failed
        self.file: IO | None = None

    def _guarded(self, when: str, write: Callable[[], None]) -> None:
        """Runs `write` unless a write failed before; `when` ("at step 12") goes into the warning."""
        if self.stopped is not None:
            return
        try:
            write()
        except OSError as e:
            self.stopped = f"{when}: {_reason(e, self.path)}"
            logger.warning(f"cannot write the {self.what} {self.path} {self.stopped}; it is not written for the rest "
                           "of this run, which trains on: the step lines still print and checkpoints are saved as "
                           "before (a save that does not fit ends the run with exit code 4)")
            self._abandon()

    def _abandon(self) -> None:
        """Lets go of the file after a failed write (its buffer may hold what could not be written)."""
        if self.file is not None:
            try:
                self.file.close()  # flushes that buffer once more, then closes in any case
            except OSError:
                pass
            self.file = None

    def close(self) -> None:
        if self.file is not None:
            self._guarded("at the end of the run", self.file.close)


class JsonRowsFile(MetricsFile):
    """A file of one JSON object per line, each flushed as written (metrics.jsonl, goodput.jsonl)."""

    file: Any = None

    def write(self, row: dict[str, Any], step: int | None) -> None:
        def write_row() -> None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()

        self._guarded("at the end of the run" if step is None else f"at step {step}", write_row)


class JsonlFile(JsonRowsFile):
    """metrics.jsonl of rank 0: one row per logged step, and records of other kinds."""

    what = "metrics file"

    def __init__(self, path: str, resumed_step: int):
        super().__init__(path)
        self.kept_validations: dict[int, float] = {}

        def open_it() -> None:
            self.file = _open_jsonl(path, resumed_step)
            self.kept_validations = _kept_validations(self.file)

        self._guarded("at start-up", open_it)

    def _abandon(self) -> None:
        super()._abandon()
        with contextlib.suppress(FileNotFoundError):  # a resumed run's rewrite that failed (_open_jsonl)
            os.remove(self.path + ".tmp")


class TensorBoardFile(MetricsFile):
    """A TensorBoard event file of scalars, written as each step is logged.

    Written here, in this thread, rather than through torch's SummaryWriter: its background thread
    dies on a failed write with a traceback of its own, and re-raises the error at a later, unrelated
    call; it also holds up to two minutes of scalars in memory, which a crash loses."""

    what = "TensorBoard event file"

    def __init__(self, folder: str):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter

        # TensorBoard's naming; the last part tells apart two files of one process and second.
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{time.time_ns()}"
        super().__init__(os.path.join(folder, name))

        def open_it() -> None:
            os.makedirs(folder, exist_ok=True)
            self.file = open(self.path, "ab")
            self.records = RecordWriter(self.file)
            self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))

        self._guarded("at start-up", open_it)

    def _write(self, event: Any) -> None:
        self.records.write(event.SerializeToString())
        self.file.flush()

    def add_scalars(self, values: dict[str, float], step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()])
        self._guarded(f"at step {step}", lambda: self._write(Event(wall_time=time.time(), step=step, summary=summary)))


def _open_jsonl(path: str, resumed_step: int) -> IO[str]:
    """Opens metrics.jsonl for appending this run's rows.

    A resumed run continues the file, keeping the rows up to its checkpoint's step and dropping
    later ones, which an interrupted job logged but will now train again, so that every step
    appears once; an earlier run's setup record (setup_record.py) stays while a step it trained
    stays, i.e. when its `first_step` is at most the checkpoint's step, and an earlier run's summary
    while its `last_step` is (validation rows are kept by step). A fresh run must neither
    mix its steps into an earlier run's file nor destroy it: an existing file is renamed to
    metrics.<n>.jsonl (the first free n) and a new one started.
    """
    if resumed_step <= 0:
        if os.path.exists(path) and os.path.getsize(path) > 0:
            root, ext = os.path.splitext(path)
            n = 1
            while os.path.exists(f"{root}.{n}{ext}"):
                n += 1
            os.replace(path, f"{root}.{n}{ext}")
            logger.info(f"{path} holds an earlier run's metrics: renamed it to {root}.{n}{ext}; this fresh run "
                        "writes a new one")
        return open(path, "w")
    kept = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:  # blank, or the half-written last line of a killed job
                    continue
                if not isinstance(row, dict):
                    continue
                kind = row.get("record")  # setup and summary rows span steps: see setup_record.py, progress.py
                step = row.get({"setup": "first_step", "summary": "last_step"}.get(kind, "step"), 0)
                if step <= resumed_step:
                    kept.append(line.rstrip("\n") + "\n")
    # Rewritten through a temporary file, so a crash here cannot leave the file truncated.
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
    return open(path, "a")


def _kept_validations(jsonl: IO[str]) -> dict[int, float]:
    """The validation losses an earlier run of this job left in metrics.jsonl (the rows a resumed
    run keeps: _open_jsonl), by step; empty for a fresh run."""
    if jsonl.tell() == 0:
        return {}
    found = {}
    with open(jsonl.name) as f:
        for line in f:
            row = json.loads(line)  # every line parses: _open_jsonl kept only those
            if isinstance(row, dict) and row.get("record") == "validation":
                found[int(row["step"])] = float(row["loss"])
    return found
