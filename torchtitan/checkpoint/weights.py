"""Model weights outside a training run: weights-only DCP checkpoints and torch.save files, read and written in one process.

Used by scripts/convert_checkpoint.py. Checkpoints are read only through the safe loaders of
safe_load.py and torch.save files only with `weights_only=True`. Outputs are written under a
temporary sibling name and appear under their final name only once complete; a disk that refuses
them (full, read-only) is one line (`check_room` before, `writing` during).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import shutil
import time
import warnings
from collections import Counter
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan.checkpoint import failures, folders
from torchtitan.checkpoint.failures import one_line
from torchtitan.checkpoint.folders import CheckpointError, Manifest
from torchtitan.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, read_metadata


def temporary_sibling(path: str) -> str:
    """A fresh name next to `path`, where an output is written before it is renamed to `path`."""
    path = os.path.abspath(path)
    return f"{path}.partial-{os.getpid()}-{time.time_ns()}"


def check_room(out: str, nbytes: int) -> None:
    """Refuses, before anything is written, an output on a read-only disk, or whose tensors alone
    (`nbytes`) would not fit on the disk that is to hold it."""
    folder = os.path.dirname(os.path.abspath(out))
    if failures.read_only(folder):  # the same line the writers give when they meet it (`writing`)
        raise CheckpointError(f"cannot write {out}: {os.strerror(errno.EROFS)}; write it to another folder "
                              "(nothing was left there)")
    free = failures.free_bytes(folder)
    if free is not None and nbytes > free:
        raise CheckpointError(f"not enough space for {out}: its tensors need {failures.mib(nbytes)}, the disk holding "
                              f"{folder} has {failures.mib(free)} free; free space there or write it to another folder")


# How the writers the converter uses say what the OS refused: safetensors (Rust) as `I/O error: No space
# left on device (os error 28)`; torch.save's zip writer as `open file failed with strerror: Read-only file
# system` when it cannot create the file, and as `unexpected pos 704 vs 598` when a write came short.
_OS_ERROR_NUMBER = re.compile(r"\(os error (\d+)\)")
_ZIP_OPEN_FAILED = re.compile(r"open file failed with strerror: ([^\n]+)")
_ZIP_SHORT_WRITE = re.compile(r"unexpected pos \d+ vs \d+")


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc` and what it was raised from or while handling, innermost first; DCP's CheckpointException
    stands for the exception of its lowest failing rank."""
    chain: list[BaseException] = []
    while exc is not None and all(exc is not seen for seen in chain):
        if isinstance(exc, CheckpointException) and exc.failures:
            failure = exc.failures[min(exc.failures)]
            exc = failure[0] if isinstance(failure, tuple) else failure  # (exception, stack) per rank
        chain.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return chain[::-1]


def _refusal(exc: BaseException) -> tuple[str, bool] | None:
    text = str(exc)
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.strerror or os.strerror(exc.errno), exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if type(exc).__name__ == "SafetensorError" and (number := _OS_ERROR_NUMBER.search(text)):
        code = int(number[1])
        return os.strerror(code), code in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(exc, RuntimeError) and "inline_container" in text:
        if opened := _ZIP_OPEN_FAILED.search(text):
            return opened[1].strip(), os.strerror(errno.ENOSPC) in opened[1]
        if short := _ZIP_SHORT_WRITE.search(text):
            return f"a write came out short (torch.save: {short[0]})", True
    return None


def write_failure(exc: BaseException) -> tuple[str, bool] | None:
    """(what the disk refused, whether for lack of space) for the exception of a failed write, from the
    innermost exception of its chain that says (torch.save's zip writer says it while cleaning up after
    an `iostream error`); None for any other exception, which is a bug and keeps its traceback."""
    return next((found for e in _causes(exc) if (found := _refusal(e)) is not None), None)


@contextlib.contextmanager
def writing(out: str) -> Iterator[None]:
    """Turns a write of `out` that the disk refused (read-only, full, an I/O error, however the writer
    reports it) into one CheckpointError line. The writers inside remove their temporary sibling on
    the way out, so nothing is left that could pass for the output."""
    try:
        yield
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException; only a disk's refusal becomes a line
        failure = write_failure(e)
        if failure is None:
            raise
        cause, out_of_space = failure
        folder = os.path.dirname(os.path.abspath(out))
        free = failures.free_bytes(folder) if out_of_space else None
        room = f" ({failures.mib(free)} free on the disk holding {folder})" if free is not None else ""
        fix = "free space there or write it to another folder" if out_of_space else "write it to another folder"
        raise CheckpointError(f"cannot write {out}: {cause}{room}; {fix} (nothing was left there)") from None


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """DCP warns on every single-process save or load, which is how these tools always work."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def load_model_entries(ckpt: str, dtype: str | None = None,
                       check_names: Callable[[list[str], str], None] | None = None) -> dict[str, torch.Tensor]:
    """Our FQN -> tensor for every `model.*` entry of the checkpoint (other states are skipped),
    floating-point tensors cast to `dtype` when given. `check_names(names, where)` may refuse the
    names before any tensor data is read, which for a large checkpoint is most of the time."""
    try:
        metadata = read_metadata(ckpt)
    except Exception as e:  # noqa: BLE001 - garbage bytes fail in many ways inside the unpickler (a module not found...)
        raise CheckpointError(f"checkpoint {ckpt}: its DCP metadata cannot be read safely ({one_line(e)})") from None
    entries = {k: v for k, v in metadata.state_dict_metadata.items()
               if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    if not entries:
        raise CheckpointError(f"checkpoint {ckpt} holds no model weights")
    if check_names is not None:
        check_names([k.removeprefix("model.") for k in entries], f"checkpoint {ckpt}")
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in entries.items()}
    with _single_process():
        dcp.load(state, storage_reader=SafeFileSystemReader(ckpt), planner=SafeLoadPlanner(), no_dist=True)
    cast = getattr(torch, dtype) if dtype else None
    return {k.removeprefix("model."): v.to(cast) if cast is not None and v.is_floating_point() else v
            for k, v in state.items()}


def common_dtype(tensors: Iterable[torch.Tensor]) -> str:
    """The most frequent floating-point dtype (e.g. "bfloat16"); "float32" when there is none."""
    counts = Counter(str(t.dtype).removeprefix("torch.") for t in tensors if t.is_floating_point())
    return counts.most_common(1)[0][0] if counts else "float32"


def weights_manifest(model: dict[str, torch.Tensor], name: str, flavor: str) -> Manifest:
    """The manifest of a weights-only checkpoint of `model`, recorded as the given model and flavor."""
    return Manifest(step=0, contents=["model"], model={"name": name, "flavor": flavor},
                    dtype=common_dtype(model.values()))


def write_weights(model: dict[str, torch.Tensor], out: str, manifest: Manifest,
                  extra: Callable[[str], None] | None = None) -> None:
    """Writes `model` (our FQN -> tensor) as a weights-only checkpoint at `out`: into a temporary
    sibling first, then published (manifest last, then renamed), so `out` is never half-written.
    `extra(folder)` may add files before publication; the manifest then records their sizes too."""
    tmp = temporary_sibling(out)
    try:
        with _single_process():
            dcp.save({"model": model}, checkpoint_id=tmp, no_dist=True)
        if extra is not None:
            extra(tmp)
        if os.path.isdir(out):  # an empty output folder, which the caller accepted: publish renames onto it
            os.rmdir(out)
        folders.publish(tmp, os.path.abspath(out), manifest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_torch_file(model: dict[str, torch.Tensor], path: str) -> None:
    """torch.save of `model` at `path`, which appears only once the file is complete."""
    tmp = temporary_sibling(path)
    try:
        torch.save(model, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_torch_file(path: str) -> dict[str, torch.Tensor]:
    """A state dict of name -> tensor from a torch.save file, loaded with weights_only=True; a
    `model.` prefix on every name (a DCP-style state dict) is dropped."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # The safe unpickler names the global it refused; other unpickling errors mean a foreign file.
        named = [line.strip() for line in str(e).splitlines() if "GLOBAL" in line]
        if named:
            raise CheckpointError(f"{path} needs arbitrary unpickling to load ({named[0]}); refused: only tensors, plain "
                                  "containers and numbers are accepted") from None
        raise CheckpointError(f"{path} is not a torch.save file (it is not a pickle torch.load can read safely)") from None
    except Exception as e:  # torch.load fails on foreign files with all kinds of exceptions
        first_line = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"{path} is not a torch.save file ({type(e).__name__}: {first_line})") from None
    if not isinstance(loaded, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()):
        raise CheckpointError(f"{path} does not hold a state dict (a dict of parameter name -> tensor)")
    if loaded and all(str(k).startswith("model.") for k in loaded):
        loaded = {k.removeprefix("model."): v for k, v in loaded.items()}
    return loaded
