"""Checkpoint folders on disk: names, the completion manifest, discovery and atomic publication.

A save is written into `step-N.partial-<attempt>`. Once every rank's files are on disk, rank 0
writes `manifest.json` into it (what the checkpoint holds and the size of every file) and renames
the folder to `step-N`. A `step-N` folder is therefore complete unless something damaged it later,
which the sizes in the manifest reveal; a `.partial-` folder is a save that never finished and is
never loaded. Nothing here imports torch: the checks run in milliseconds and work for tools too.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from torchtitan.errors import CheckpointError

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"  # written by torch.distributed.checkpoint, last among its own files
FORMAT = "torchtitan-dcp-1"
_FINAL = re.compile(r"^step-(\d+)$")
_PARTIAL = re.compile(r"^step-(\d+)\.partial-")
_DELETING = ".deleting-"


class CheckpointSaveError(CheckpointError):
    """A save that could not be written (disk full, read-only, an I/O error). Every rank stops
    at the same step; the unfinished folder is removed and every earlier checkpoint stays. The
    trainer exits with `exit_code`, so a scheduler can tell it from a configuration mistake (2)."""

    exit_code = 4


@dataclass
class Manifest:
    """What a complete checkpoint holds; written last, so its presence marks completion."""

    step: int
    contents: list[str]  # the Stateful names saved; ["model"] for weights-only checkpoints
    files: dict[str, int] = field(default_factory=dict)  # file name -> size in bytes
    model: dict[str, str] = field(default_factory=dict)  # {"name": ..., "flavor": ...}
    model_args: dict[str, Any] = field(default_factory=dict)  # the writer's model args (shapes, vocabulary, ...)
    tied: dict[str, str] | None = None  # parameter -> the one whose weight it shares; None: not recorded
    layout: dict[str, int] = field(default_factory=dict)  # parallel degrees and world size of the writer
    data_shards: int | None = None  # data shards whose positions the checkpoint keeps
    # {"sequences": of one optimizer step over all data-parallel ranks, "seq_len": ...}; None: not recorded
    global_batch: dict[str, int] | None = None
    tokens_seen: int = 0
    dtype: str | None = None  # weights-only exports: the dtype the weights were cast to
    # The run's tokenizer: {"path": a bundled: name or an absolute path, "sha256": of the file}, so
    # tools that read the checkpoint (scripts/generate.py) find it and notice another in its place.
    tokenizer: dict[str, str] | None = None
    # What scripts/convert_checkpoint.py made the weights from (a Hugging Face folder, a torch.save
    # file); None for a checkpoint a run wrote. Such weights are loaded like that folder would be.
    converted_from: str | None = None
    # A LoRA run's checkpoint (docs/lora.md): {"rank", "alpha", "target_modules", "adapters_only": the
    # model state holds the adapters alone, "base": the checkpoint.initial_load_path its frozen base
    # weights come from}; None otherwise.
    lora: dict[str, Any] | None = None
    saved_at: str = ""
    format: str = FORMAT

    @property
    def weights_only(self) -> bool:
        return self.contents == ["model"]

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

    @classmethod
    def read(cls, folder: str) -> Manifest:
        with open(os.path.join(folder, MANIFEST)) as f:
            raw = json.load(f)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} manifest")
        known = {name for name in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in raw.items() if k in known})


def final_name(step: int) -> str:
    return f"step-{step}"


def partial_name(step: int, attempt: str) -> str:
    return f"step-{step}.partial-{attempt}"


def _file_sizes(folder: str) -> dict[str, int]:
    sizes = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            sizes[os.path.relpath(path, folder)] = os.path.getsize(path)
    return sizes


def folder_bytes(folder: str) -> int:
    return sum(_file_sizes(folder).values())


def problem_with(folder: str) -> str | None:
    """Why `folder` is not a complete checkpoint of this project, or None if it is one."""
    if not os.path.isdir(folder):
        return "does not exist" if not os.path.exists(folder) else "is not a folder"
    if not os.path.exists(os.path.join(folder, MANIFEST)):
        if os.path.exists(os.path.join(folder, DCP_METADATA)):
            return f"has no {MANIFEST} (its save never finished)"
        return f"is not a checkpoint (no {MANIFEST} and no DCP {DCP_METADATA} file)"
    try:
        manifest = Manifest.read(folder)
    except (OSError, ValueError, TypeError) as e:
        return f"has a damaged {MANIFEST} ({e})"
    for name, size in manifest.files.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"is damaged: its file {name} is missing"
        actual = os.path.getsize(path)
        if actual != size:
            return f"is damaged: its file {name} has {actual} bytes, {size} were written (truncated or overwritten)"
    return None


@dataclass
class Found:
    """One `step-N` folder in a checkpoint folder."""

    step: int
    path: str
    problem: str | None  # why it cannot be loaded; None when complete
    manifest: Manifest | None = None


def scan(folder: str) -> tuple[list[Found], list[str]]:
    """The `step-N` folders under `folder`, oldest first, each checked; and the paths of
    interrupted saves (`step-N.partial-*`)."""
    if not os.path.isdir(folder):
        return [], []
    found, partial = [], []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if match := _FINAL.match(name):
            problem = problem_with(path)
            found.append(Found(int(match.group(1)), path, problem, None if problem else Manifest.read(path)))
        elif _PARTIAL.match(name):
            partial.append(path)
    return sorted(found, key=lambda f: f.step), sorted(partial)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    """Deletes a checkpoint folder so that a crash half-way never leaves a `step-N` folder with
    some files gone: it is renamed out of the `step-N` namespace first."""
    doomed = f"{path}{_DELETING}{time.time_ns()}"
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def publish(partial: str, final: str, manifest: Manifest) -> Manifest:
    """Makes the finished save in `partial` visible as `final` (rank 0, once every rank's files
    are written): records each file's size in the manifest, writes it durably, then renames."""
    manifest.files = _file_sizes(partial)
    manifest.saved_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    tmp = os.path.join(partial, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(asdict(manifest), f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(partial, MANIFEST))
    _fsync_dir(partial)
    if os.path.exists(final):  # an older or damaged save of the same step: the new one replaces it
        logger.warning(f"replacing {final} with the new save of step {manifest.step}")
        remove(final)
    os.rename(partial, final)
    _fsync_dir(os.path.dirname(final) or ".")
    return manifest


def to_purge(found: list[Found], keep_latest_k: int) -> list[Found]:
    """Complete checkpoints beyond the newest `keep_latest_k` (0 keeps all). The newest full
    (resumable) checkpoint always stays, even when newer weights-only exports fill the k slots;
    damaged folders are left for the user to inspect."""
    complete = [f for f in found if f.problem is None]
    if keep_latest_k <= 0 or len(complete) <= keep_latest_k:
        return []
    keep = {f.path for f in complete[-keep_latest_k:]}
    full = [f for f in complete if not f.manifest.weights_only]
    if full:
        keep.add(full[-1].path)
    return [f for f in complete if f.path not in keep]


def describe_steps(found: list[Found]) -> str:
    steps = [str(f.step) for f in found if f.problem is None]
    return f"complete checkpoints: {', '.join(steps)}" if steps else "it holds no complete checkpoint"

