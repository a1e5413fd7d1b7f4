"""CheckpointManager: saves and restores every Stateful of a run through torch.distributed.checkpoint.

Checkpoints are `step-N` folders under job.dump_folder/checkpoint.folder (see folders.py for how
a save becomes visible only once complete). Model and optimizer state use fully qualified
parameter names, so a checkpoint loads under any parallel layout: DCP reshards on load. The data
position is kept per data shard, and the shard count travels with the checkpoint, so it survives
a change of data-parallel degree too.

The run asks two things of the manager: before the data loader exists, `find_resume_point`
decides which checkpoint the run starts from; once the model and optimizers exist, a
CheckpointManager loads it and saves new ones.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.checkpoint import folders
from torchtitan.checkpoint.folders import CheckpointError, Manifest
from torchtitan.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, read_metadata
from torchtitan.checkpoint.states import DataState, ModelState, RNGState, TrainState
from torchtitan.config_manager import JobConfig
from torchtitan.parallelisms.parallel_dims import MESH_DIM_ORDER, ParallelDims

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class ResumePoint:
    """The checkpoint a run starts from."""

    path: str
    weights_only: bool  # model weights that start a new run at step 0 (seed, export, initial_load_path)
    manifest: Manifest | None  # None for a DCP folder written by another tool

    def adopt_data_shards(self, job_config: JobConfig, dp_degree: int) -> None:
        """Reads the data with the shard count the checkpoint's data position refers to.

        With `training.dataset_shards = -1` the count follows the checkpoint (not this run's
        data-parallel degree), so a resumed run neither repeats nor skips documents. Any other
        count would not match the saved position, and is refused.
        """
        if self.weights_only or self.manifest is None or self.manifest.data_shards is None:
            return
        saved, t = self.manifest.data_shards, job_config.training
        if t.dataset_shards not in (-1, saved):
            raise CheckpointError(
                f"{self.path} keeps the data position of {saved} data shards, but training.dataset_shards is "
                f"{t.dataset_shards}; set it to {saved} (or -1) to resume, or start a new run from the weights "
                "with checkpoint.initial_load_path"
            )
        if saved % dp_degree:
            raise CheckpointError(
                f"{self.path} keeps the data position of {saved} data shards, which {dp_degree} data-parallel ranks "
                f"cannot split evenly; use a data-parallel degree that divides {saved}"
            )
        if t.dataset_shards == -1 and saved != dp_degree:
            logger.info(f"reading the data as {saved} shards, as the checkpoint does ({saved // dp_degree} per "
                        "data-parallel rank)")
        t.dataset_shards = saved


def _decide_on_rank0(fn) -> Any:
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
    return _decide_on_rank0(lambda: _find_resume_point(job_config))


def _find_resume_point(job_config: JobConfig) -> ResumePoint | None:
    c = job_config.checkpoint
    folder = os.path.join(job_config.job.dump_folder, c.folder)
    if c.enable_checkpoint:
        found, partial = folders.scan(folder)
        if c.load_step >= 0:
            return _requested_step(found, folder, c.load_step)
        for path in partial:
            logger.warning(f"ignoring {path}: a save that never finished")
        usable = []
        for f in reversed(found):
            if f.problem is not None:
                logger.warning(f"skipping checkpoint {f.path}: it {f.problem}")
            else:
                usable.append(f)
        full = [f for f in usable if not f.manifest.weights_only]
        if full:
            f = full[0]
            return ResumePoint(f.path, False, f.manifest)
        if usable:
            f = usable[0]
            logger.info(f"{f.path} holds model weights only: the run starts from them at step 0")
            return ResumePoint(f.path, True, f.manifest)
    if c.initial_load_path:
        return _initial_weights(c.initial_load_path)
    return None


def _requested_step(found: list[folders.Found], folder: str, step: int) -> ResumePoint:
    match = next((f for f in found if f.step == step), None)
    if match is None:
        describe = "the folder does not exist" if not os.path.isdir(folder) else folders.describe_steps(found)
        raise CheckpointError(f"checkpoint.load_step {step}: there is no step-{step} in {folder} ({describe})")
    if match.problem is not None:
        raise CheckpointError(f"checkpoint.load_step {step}: {match.path} {match.problem}")
    return ResumePoint(match.path, match.manifest.weights_only, match.manifest)


def _initial_weights(path: str) -> ResumePoint:
    """A folder of model weights to start from: one of ours (checked against its manifest) or a
    plain DCP folder written by another tool."""
    problem = folders.problem_with(path)
    if problem is None:
        return ResumePoint(path, True, Manifest.read(path))
    if problem.startswith("has no manifest") and os.path.isfile(os.path.join(path, folders.DCP_METADATA)):
        return ResumePoint(path, True, None)  # not written by this project: DCP's own checks apply
    raise CheckpointError(f"checkpoint.initial_load_path {path} {problem}")


def _layout(parallel_dims: ParallelDims) -> dict[str, int]:
    return {**{name: getattr(parallel_dims, name) for name in MESH_DIM_ORDER}, "world_size": parallel_dims.world_size}


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> dict[str, Any]:
    """DCP's key for every leaf of a nested state dict (dicts joined with dots)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}", item, out)
    else:
        out[prefix] = value
    return out


def _shape_problem(key: str, value: Any, metadata: Metadata) -> str | None:
    saved = metadata.state_dict_metadata.get(key)
    if saved is None:
        return f"has no entry {key}"
    if isinstance(value, torch.Tensor):
        if not isinstance(saved, TensorStorageMetadata):
            return f"holds {key} as a non-tensor value"
        shape = tuple(value.shape)  # a DTensor reports its global shape
        if tuple(saved.size) != shape:
            return f"holds {key} with shape {list(saved.size)}, but this run's is {list(shape)}"
    return None


class CheckpointManager:
    """Saves the run's states every `checkpoint.interval` steps and at the end; loads the
    resume point. At most one asynchronous save is in flight; `close()` waits for it."""

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims, model_parts: list[nn.Module],
                 optimizers: Stateful, lr_schedulers: Stateful, dataloader: Any, train_state: TrainState):
        c = job_config.checkpoint
        self.job_config = job_config
        self.enabled = c.enable_checkpoint or c.create_seed_checkpoint
        self.folder = os.path.join(job_config.job.dump_folder, c.folder)
        self.interval, self.keep_latest_k = c.interval, c.keep_latest_k
        self.weights_only_at_end, self.export_dtype = c.model_weights_only, _DTYPES[c.export_dtype]
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.layout = _layout(parallel_dims)
        # The shard count the data position refers to (-1 resolves to one per data-parallel rank).
        shards = job_config.training.dataset_shards
        self.data_shards = shards if shards > 0 else parallel_dims.dp_degree
        self.train_state = train_state
        self.model = ModelState(model_parts)
        self.states: dict[str, Stateful] = {
            "model": self.model,
            "optimizer": optimizers,
            "lr_scheduler": lr_schedulers,
            "dataloader": DataState(dataloader),
            "train_state": train_state,
            "rng": RNGState(self.rank),
        }
        self._in_flight: tuple[Any, str, Manifest, float] | None = None
        self._async = None
        if self.enabled and c.async_mode != "disabled":
            from torchtitan.checkpoint.async_save import AsyncSaver

            self._async = AsyncSaver(c.async_mode)
        # One name for this job's unfinished saves, the same on every rank.
        self._attempt = _decide_on_rank0(lambda: f"{os.getpid()}-{time.time_ns()}")
        self._cleaned = False

    # ----------------------------------------------------------------------------------------
    # Loading

    def load(self, resume: ResumePoint | None) -> None:
        if resume is None:
            return
        contents = ["model"] if resume.weights_only else list(resume.manifest.contents)
        try:
            metadata = read_metadata(resume.path)
        except (OSError, EOFError, ValueError, pickle.UnpicklingError) as e:
            raise CheckpointError(f"{resume.path} cannot be read safely: its DCP metadata is unreadable ({e})") from e
        top_level = not any(key.startswith("model.") for key in metadata.state_dict_metadata)
        states = {name: self.states[name] for name in contents}
        if "rng" in states and not self._rng_restorable(resume, metadata):
            logger.info("random generator states not restored: they belong to the ranks of another layout")
            del states["rng"]
        self._check_fits(resume, metadata, states, top_level)
        start = time.perf_counter()
        reader, planner = SafeFileSystemReader(resume.path), SafeLoadPlanner()
        try:
            if top_level:  # weights saved by another tool, without our "model." prefix
                model_sd = self.model.state_dict()
                dcp.load(model_sd, storage_reader=reader, planner=planner, no_dist=not dist.is_initialized())
                self.model.load_state_dict(model_sd)
            else:
                dcp.load(states, storage_reader=reader, planner=planner, no_dist=not dist.is_initialized())
        except CheckpointException as e:  # every rank sees the failure: DCP gathers them
            first = next(iter(e.failures.values()), e)
            raise CheckpointError(f"loading {resume.path} failed: {type(first).__name__}: "
                                  f"{str(first).strip().splitlines()[-1] if str(first).strip() else ''}") from e
        seconds = time.perf_counter() - start
        mib = folders.folder_bytes(resume.path) / 2**20
        loaded = f"loaded {', '.join(states)} from {resume.path} in {seconds:.2f}s ({mib / seconds:.0f} MiB/s)"
        if resume.weights_only:
            logger.info(loaded)
        else:
            logger.info(f"{loaded}: resuming after step {self.train_state.step} "
                        f"({self.train_state.tokens_seen:,} tokens seen)")

    def _rng_restorable(self, resume: ResumePoint, metadata: Metadata) -> bool:
        """Generator states are per rank: restored only by the layout that wrote them (all ranks
        decide alike, from the manifest and the metadata every rank reads)."""
        keys = _flatten("rng", self.states["rng"].state_dict(), {})
        return resume.manifest.layout == self.layout and all(k in metadata.state_dict_metadata for k in keys)

    def _check_fits(self, resume: ResumePoint, metadata: Metadata, states: dict[str, Stateful], top_level: bool) -> None:
        """Refuses, on every rank alike and before anything is loaded, a checkpoint whose entries
        do not match this run's states (another model flavor, another optimizer)."""
        local: dict[str, Any] = {}
        for name, state in states.items():
            _flatten("" if top_level and name == "model" else name, state.state_dict(), local)
        local = {k.lstrip("."): v for k, v in local.items()}
        problem = next((p for k, v in local.items() if (p := _shape_problem(k, v, metadata))), None)
        model_keys = {k for k in local if top_level or k.startswith("model.")}
        if dist.is_initialized():
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (problem, model_keys))
            problem = next((p for p, _ in gathered if p), None)
            model_keys = set().union(*(keys for _, keys in gathered))
        if problem is None:
            saved = {k for k in metadata.state_dict_metadata if top_level or k.startswith("model.")}
            extra = sorted(saved - model_keys)
            if extra:
                problem = f"holds {len(extra)} model entries this model does not have, e.g. {extra[0]}"
        if problem is not None:
            origin = ""
            if resume.manifest is not None and resume.manifest.model:
                origin = f" (written by {resume.manifest.model.get('name')} {resume.manifest.model.get('flavor')})"
            m = self.job_config.model
            raise CheckpointError(f"checkpoint {resume.path}{origin} does not fit {m.name} {m.flavor}: it {problem}; "
                                  "check model.flavor and the optimizer settings")

    # ----------------------------------------------------------------------------------------
    # Saving

    def save(self, step: int, *, last: bool = False, loss: torch.Tensor | None = None,
             grad_norm: torch.Tensor | None = None) -> None:
        """Saves at every `interval`-th step and at the last one, unless the step's loss or
        gradient norm is not finite on some rank (such a state never replaces a good one)."""
        self._publish_finished_async_save(block=False)
        if not self.enabled or not (last or step % self.interval == 0):
            return
        if not self._all_finite(loss, grad_norm):
            logger.warning(f"step {step}: the loss or gradient norm is not finite; no checkpoint is saved "
                           f"(the newest good one stays in {self.folder})")
            return
        if last and self.weights_only_at_end:
            self._write(step, {"model": self.model.exported(self.export_dtype)}, dtype=self.export_dtype)
        else:
            self._write(step, self.states)

    def save_seed(self) -> None:
        """The freshly initialised model weights as step 0 (one process; see create_seed_checkpoint)."""
        self._write(0, {"model": self.model})
        self.close()

    def _all_finite(self, loss: torch.Tensor | None, grad_norm: torch.Tensor | None) -> bool:
        values = [v.detach().float().reshape(1) for v in (loss, grad_norm) if v is not None]
        if not values:
            return True
        bad = (~torch.isfinite(torch.cat(values))).any().float()
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad.item())

    def _write(self, step: int, states: dict[str, Any], dtype: torch.dtype | None = None) -> None:
        start = time.perf_counter()
        self._publish_finished_async_save(block=True)  # at most one save in flight
        self._clean_up_unfinished_saves()
        partial = os.path.join(self.folder, folders.partial_name(step, self._attempt))
        manifest = Manifest(
            step=step, contents=list(states), model={"name": self.job_config.model.name,
                                                     "flavor": self.job_config.model.flavor},
            layout=self.layout, data_shards=self.data_shards if "dataloader" in states else None,
            tokens_seen=self.train_state.tokens_seen, dtype=str(dtype).removeprefix("torch.") if dtype else None,
        )
        if self._async is not None:
            self._in_flight = (self._async.save(states, partial), partial, manifest, start)
            logger.info(f"step {step}: checkpoint staged, the training loop waited {time.perf_counter() - start:.2f}s; "
                        "the rest is written in the background")
        else:
            dcp.save(states, checkpoint_id=partial, no_dist=not dist.is_initialized())
            self._publish(partial, manifest, start)

    def _publish(self, partial: str, manifest: Manifest, start: float) -> None:
        if self.rank != 0:
            return
        final = os.path.join(self.folder, folders.final_name(manifest.step))
        folders.publish(partial, final, manifest)
        seconds = time.perf_counter() - start
        mib = manifest.total_bytes / 2**20
        waited = "the training loop waited all along" if self._async is None else "written in the background"
        logger.info(f"saved checkpoint {final} ({mib:.1f} MiB, {', '.join(manifest.contents)}) in {seconds:.2f}s "
                    f"({mib / seconds:.0f} MiB/s; {waited})")
        found, _ = folders.scan(self.folder)
        for old in folders.to_purge(found, self.keep_latest_k):
            folders.remove(old.path)
            logger.info(f"removed {old.path} (checkpoint.keep_latest_k {self.keep_latest_k})")

    def _publish_finished_async_save(self, block: bool) -> None:
        if self._in_flight is None:
            return
        future, partial, manifest, start = self._in_flight
        if not block and not future.done():
            return
        self._in_flight = None
        try:
            future.result()
        except Exception as e:
            raise CheckpointError(f"the background save of step {manifest.step} failed ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}); {partial} is not a checkpoint") from e
        self._publish(partial, manifest, start)

    def _clean_up_unfinished_saves(self) -> None:
        """Removes folders of earlier jobs' saves that never finished (rank 0, once per job)."""
        if self._cleaned or self.rank != 0:
            return
        self._cleaned = True
        _, partial = folders.scan(self.folder)
        for path in partial:
            if not path.endswith(self._attempt):
                logger.warning(f"removing {path}: a save that never finished")
                folders.remove(path)

    def close(self) -> None:
        """Waits for the save in flight and publishes it (the last save is never left behind)."""
        self._publish_finished_async_save(block=True)
        if self._async is not None:
            self._async.close()
            self._async = None

