"""Checkpoint reads and writes that fail, reduced to one line; and the free-space check before a save.

DCP gathers every rank's exception into a CheckpointException whose text is each rank's whole
stack (over a thousand characters for one flipped bit). What a user needs is the root cause and
the rank: `one_line()` digs it out. A save that would not fit on the disk is refused before any
file is written: `SpaceCheckingSavePlanner` adds up the bytes every rank will write, after DCP
has removed replicated copies, and compares them with the free space where they go.
"""

from __future__ import annotations

import errno
import math
import os
import pickle
import re
import shutil
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

_MAX_CHARS = 200  # of a root cause's message in the one line


def _root(exc: BaseException) -> BaseException:
    """The innermost cause of a chain of exceptions (`raise ... from e`, or raised while handling e)."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if inner is None:
            break
        exc = inner
    return exc


def root_cause(exc: BaseException) -> BaseException:
    """The innermost cause of `exc`; for DCP's gathered CheckpointException, of the lowest failing rank's."""
    if isinstance(exc, CheckpointException) and exc.failures:
        failure = exc.failures[min(exc.failures)]
        exc = failure[0] if isinstance(failure, tuple) else failure  # (exception, stack) per rank
    return _root(exc)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{where}"
    text = " ".join(str(exc).split())  # one line, whatever the message's own layout
    if isinstance(exc, pickle.UnpicklingError):  # says itself what it is (e.g. the safe reader's refusal)
        return text[:_MAX_CHARS]
    # Messages such as PyTorch's zip reader's carry a paragraph of advice after the first sentence.
    first = re.split(r"\.\s+(?=[A-Z])", text)[0]
    if len(first) > _MAX_CHARS:
        first = first[:_MAX_CHARS - 3] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def one_line(exc: BaseException) -> str:
    """The root cause of a failed checkpoint read or write, e.g. `No space left on device:
    /ckpt/step-4.partial-x/__1_0.distcp (rank 1)`."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, failure = min(exc.failures.items())
        inner = failure[0] if isinstance(failure, tuple) else failure  # (exception, stack) per rank
        ranks = f"rank {rank}" if len(exc.failures) == 1 else f"ranks {', '.join(map(str, sorted(exc.failures)))}"
        return f"{_describe(_root(inner))} ({ranks})"
    return _describe(_root(exc))


def is_out_of_space(exc: BaseException) -> bool:
    if isinstance(exc, CheckpointException):
        return any(is_out_of_space(f[0] if isinstance(f, tuple) else f) for f in exc.failures.values())
    root = _root(exc)
    return isinstance(root, OSError) and root.errno in (errno.ENOSPC, errno.EDQUOT)


def save_failure(exc: BaseException, folder: str) -> str:
    """One line for a failed save. A full disk does not always say so (PyTorch's zip writer
    reports `unexpected pos 704 vs 598`), so the free space is added unless the cause is another
    OSError (read-only, permissions), or our own refusal, which names it already."""
    line = one_line(exc)
    root = root_cause(exc)
    if isinstance(root, NotEnoughSpace) or (isinstance(root, OSError) and not is_out_of_space(root)):
        return line
    free = free_bytes(folder)
    return line if free is None else f"{line} ({mib(free)} free on the disk holding {folder})"


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def free_bytes(path: str) -> int | None:
    """Free bytes on the file system that holds `path` (or would hold it: its nearest existing
    parent); None when that cannot be measured."""
    try:
        return shutil.disk_usage(_nearest_existing(path)).free
    except OSError:
        return None


def read_only(path: str) -> bool:
    """Whether the file system that holds (or would hold) `path` is mounted read-only: its free space
    then says nothing about why a write fails."""
    try:
        return bool(os.statvfs(_nearest_existing(path)).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


class NotEnoughSpace(OSError):
    """Raised before a save writes anything: the checkpoint would not fit on the disk."""

    def __init__(self, path: str, needed: int, free: int):
        self.path, self.needed, self.free = path, needed, free
        super().__init__(errno.ENOSPC, f"not enough space for the checkpoint: it needs {mib(needed)}, the disk holding "
                                       f"{os.path.dirname(os.path.abspath(path))} has {mib(free)} free")

    def __reduce__(self):
        # DCP pickles the coordinator's exception to hand it to every rank; OSError's own pickling
        # would rebuild it from (errno, message), which this constructor does not take.
        return type(self), (self.path, self.needed, self.free)


def planned_bytes(plans: list[SavePlan]) -> int:
    """Bytes of tensor data the plans write (each replicated tensor once: DCP has deduplicated)."""
    total = 0
    for plan in plans:
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
                itemsize = item.tensor_data.properties.dtype.itemsize
                total += math.prod(item.tensor_data.chunk.sizes) * itemsize
    return total


class SpaceCheckingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which refuses the save on the coordinator, while planning and
    so before any rank writes a byte, when the checkpoint would not fit on the disk. DCP hands
    the refusal to every rank, so all of them stop the save together."""

    # Room left for what is not counted: pickled entries, .metadata, manifest.json.
    MARGIN_BYTES = 2**20

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(all_plans)
        needed = planned_bytes(self.global_plan) * 101 // 100 + self.MARGIN_BYTES  # the full plans, not deltas
        free = free_bytes(self.path)
        if free is not None and needed > free:
            raise NotEnoughSpace(self.path, needed, free)
        return plans, metadata


def gather_from_ranks(obj: Any) -> list[Any]:
    """`obj` from every rank, in rank order (just `[obj]` in a single process)."""
    if not dist.is_initialized():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def first_error(error: str | None) -> str | None:
    """The first rank's error, on every rank: a failure seen by one rank stops them all together."""
    return next((e for e in gather_from_ranks(error) if e is not None), None)
