"""Which checkpoint a run starts from, decided before the data loader exists.

In order: `checkpoint.load_step`; the newest complete full checkpoint; the newest complete
weights-only one (a seed or an export); `checkpoint.initial_load_path`; nothing. A candidate that
is damaged (a file missing or of another size than its manifest says) or whose DCP metadata
cannot be read is skipped with a warning naming it, unless it was asked for by name.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

import torch.distributed as dist

from torchtitan.checkpoint import folders
from torchtitan.checkpoint.failures import one_line
from torchtitan.checkpoint.folders import CheckpointError, Manifest
from torchtitan.checkpoint.hf_training import is_hf_folder
from torchtitan.checkpoint.safe_load import read_metadata
from torchtitan.config.job_config import JobConfig
from torchtitan.models import get_train_spec

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ResumePoint:
    """The checkpoint a run starts from."""

    path: str
    weights_only: bool  # model weights that start a new run at step 0 (seed, export, initial_load_path)
    manifest: Manifest | None  # None for a DCP folder written by another tool, or a Hugging Face folder
    hf: bool = False  # a Hugging Face folder (config.json + safetensors), read by hf_training.py

    def data_shards(self, configured: int, dp_degree: int) -> int | None:
        """The shard count the data must be read in to continue from this checkpoint's data
        position, or None when it has none (weights only, or written by another tool).

        With `training.dataset_shards = -1` (`configured`) the count follows the checkpoint, not
        this run's data-parallel degree, so a resumed run neither repeats nor skips documents.
        Any other count would not match the saved position, and is refused.
        """
        if self.weights_only or self.manifest is None or self.manifest.data_shards is None:
            return None
        saved = self.manifest.data_shards
        if configured not in (-1, saved):
            raise CheckpointError(
                f"{self.path} keeps the data position of {saved} data shards, but training.dataset_shards is "
                f"{configured}; set it to {saved} (or -1) to resume, or start a new run from the weights "
                "with checkpoint.initial_load_path"
            )
        if saved % dp_degree:
            raise CheckpointError(
                f"{self.path} keeps the data position of {saved} data shards, which {dp_degree} data-parallel ranks "
                f"cannot split evenly; use a data-parallel degree that divides {saved}"
            )
        return saved

    def batch_change(self, training: Any, dp_degree: int) -> str | None:
        """One warning line when this run's global batch differs from the one the checkpoint was
        trained with, else None. `training.batch_size` is per data-parallel rank, so the same
        options under another data-parallel degree read other batches: the run trains on, but
        its losses do not continue the saved run's. Not refused, as a new batch size on resume
        is a legitimate choice (a batch ramp-up)."""
        saved = None if self.weights_only or self.manifest is None else self.manifest.global_batch
        now = global_batch(training, dp_degree)
        if saved is None or saved == now:
            return None
        per_step = dp_degree * training.gradient_accumulation_steps
        fixes = [f"training.seq_len {saved['seq_len']}"] if saved["seq_len"] != now["seq_len"] else []
        if saved["sequences"] != now["sequences"]:
            fixes.append(f"training.batch_size {saved['sequences'] // per_step}" if saved["sequences"] % per_step == 0
                         else f"a data-parallel degree x training.batch_size x gradient_accumulation_steps of "
                              f"{saved['sequences']}")
        return (f"{self.path} was trained with a global batch of {saved['sequences']} x {saved['seq_len']} tokens, this "
                f"run's is {now['sequences']} x {now['seq_len']} (training.batch_size {training.batch_size} on each "
                f"of {dp_degree} data-parallel ranks, gradient_accumulation_steps {training.gradient_accumulation_steps}): it "
                f"trains on other batches, so its losses do not continue the saved run's; to continue it, set "
                f"{' and '.join(fixes)}")


def global_batch(training: Any, dp_degree: int) -> dict[str, int]:
    """The sequences of one optimizer step over all data-parallel ranks, and their length
    (training.batch_size is per data-parallel rank and micro-step)."""
    return {"sequences": training.batch_size * dp_degree * training.gradient_accumulation_steps,
            "seq_len": training.seq_len}


def decide_on_rank0(fn: Callable[[], Any]) -> Any:
    """Runs `fn` on rank 0 only and hands its result (or its CheckpointError) to every rank, so
    all ranks act on one view of the file system and warnings are printed once."""
    if not dist.is_initialized():
        return fn()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = fn()
        except CheckpointError as e:
            box[0] = e
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], CheckpointError):
        raise box[0]
    return box[0]


def find_resume_point(job_config: JobConfig) -> ResumePoint | None:
    """Which checkpoint the run starts from: `checkpoint.load_step`, else the newest complete
    full checkpoint (damaged or unfinished ones are skipped with a warning), else the newest
    weights-only one (seed or export), else `checkpoint.initial_load_path`, else none."""
    point = decide_on_rank0(lambda: _find_resume_point(job_config))
    if point is None and job_config.lora.rank > 0:  # every rank alike: the point was decided on rank 0
        folder = os.path.join(job_config.job.dump_folder, job_config.checkpoint.folder)
        raise CheckpointError(f"lora.rank {job_config.lora.rank} needs base weights: checkpoint.initial_load_path is "
                              f"unset and {folder} holds no checkpoint to resume; set checkpoint.initial_load_path to "
                              "the base model's checkpoint or Hugging Face folder")
    return point


def _find_resume_point(job_config: JobConfig) -> ResumePoint | None:
    checkpoint = job_config.checkpoint
    folder = os.path.join(job_config.job.dump_folder, checkpoint.folder)
    if checkpoint.enable_checkpoint:
        found, partial = folders.scan(folder)
        if checkpoint.load_step >= 0:
            return _requested_step(found, folder, checkpoint.load_step)
        for path in partial:
            logger.warning(f"ignoring {path}: a save that never finished")
        usable = []
        for f in reversed(found):
            if f.problem is not None:
                logger.warning(f"skipping checkpoint {f.path}: it {f.problem}")
            else:
                usable.append(f)
        full = [f for f in usable if not f.manifest.weights_only]
        weights = [f for f in usable if f.manifest.weights_only]
        for f in [*full, *weights]:
            # Sizes can match while the bytes are garbage (a bad copy, a disk error): the metadata
            # is read here so that such a checkpoint is skipped like a truncated one.
            problem = _metadata_problem(f.path)
            if problem is not None:
                logger.warning(f"skipping checkpoint {f.path}: {problem}")
                continue
            if f.manifest.weights_only:
                logger.info(f"{f.path} holds model weights only: the run starts from them at step 0")
            return ResumePoint(f.path, f.manifest.weights_only, f.manifest)
    if checkpoint.initial_load_path:
        return initial_weights(checkpoint.initial_load_path, job_config.model.name)
    return None


def _requested_step(found: list[folders.Found], folder: str, step: int) -> ResumePoint:
    match = next((f for f in found if f.step == step), None)
    if match is None:
        describe = "the folder does not exist" if not os.path.isdir(folder) else folders.describe_steps(found)
        raise CheckpointError(f"checkpoint.load_step {step}: there is no step-{step} in {folder} ({describe})")
    if match.problem is not None:
        raise CheckpointError(f"checkpoint.load_step {step}: {match.path} {match.problem}")
    return ResumePoint(match.path, match.manifest.weights_only, match.manifest)


def initial_weights(path: str, model_name: str) -> ResumePoint:
    """A folder of model weights to start from: one of ours (checked against its manifest), a
    plain DCP folder written by another tool, or a Hugging Face folder."""
    if is_hf_folder(path):
        # Refused here, before any model is built, rather than when the weights are read.
        if get_train_spec(model_name).hf_adapter is None:
            raise CheckpointError(f"checkpoint.initial_load_path {path} is a Hugging Face folder, but model "
                                  f"{model_name!r} has no Hugging Face conversion (TrainSpec.hf_adapter)")
        return ResumePoint(path, True, None, hf=True)
    if os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(os.path.join(path, folders.DCP_METADATA)):
        raise CheckpointError(f"checkpoint.initial_load_path {path} has a config.json but neither model.safetensors "
                              "nor model.safetensors.index.json; only safetensors weights are read (save the model "
                              "with safe_serialization, or convert its .bin files)")
    problem = folders.problem_with(path)
    if problem is None:
        return ResumePoint(path, True, Manifest.read(path))
    if problem.startswith("has no manifest") and os.path.isfile(os.path.join(path, folders.DCP_METADATA)):
        return ResumePoint(path, True, None)  # not written by this project: DCP's own checks apply
    raise CheckpointError(f"checkpoint.initial_load_path {path} {problem}")


def _metadata_problem(path: str) -> str | None:
    try:
        read_metadata(path)
    except Exception as e:  # garbage bytes fail in many ways inside the unpickler
        return f"its DCP metadata is unreadable ({one_line(e)})"
    return None
