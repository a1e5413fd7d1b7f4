"""CheckpointManager: saves and restores every Stateful of a run through torch.distributed.checkpoint.

Checkpoints are `step-N` folders under job.dump_folder/checkpoint.folder (see folders.py for how
a save becomes visible only once complete). Model and optimizer state use fully qualified
parameter names, so a checkpoint loads under any parallel layout: DCP reshards on load. The data
position is kept per data shard, and the shard count travels with the checkpoint, so it survives
a change of data-parallel degree too.

The run asks two things: before the data loader exists, `find_resume_point` (resume.py) decides
which checkpoint the run starts from; once the model and optimizers exist, a CheckpointManager
checks that it fits the model (fit.py), loads it, and saves new ones, stopping every rank with one
line when a save cannot be written (failures.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.assets import BUNDLED_PREFIX, resolve_path
from torchtitan.checkpoint import folders, hf_training
from torchtitan.checkpoint import lora as lora_checkpoint
from torchtitan.checkpoint.failures import SpaceCheckingSavePlanner, first_error, gather_from_ranks, one_line, save_failure
from torchtitan.checkpoint.fit import FitCheck, ModelRecord, build_on_meta, checkpoint_record, tied_aliases
from torchtitan.checkpoint.folders import CheckpointError, CheckpointSaveError, Manifest
from torchtitan.checkpoint.model_args import args_record
from torchtitan.checkpoint.resume import ResumePoint, decide_on_rank0, global_batch
from torchtitan.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, read_metadata
from torchtitan.checkpoint.states import DataState, ModelState, PartialState, RNGState, TrainState, flatten
from torchtitan.config.job_config import JobConfig
from torchtitan.datasets.tokenizer import hf_config_token_ids, identifying_file, tokenizer_source
from torchtitan.models import get_train_spec
from torchtitan.parallelisms.parallel_dims import MESH_DIM_ORDER, ParallelDims

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _layout(parallel_dims: ParallelDims) -> dict[str, int]:
    return {**{name: getattr(parallel_dims, name) for name in MESH_DIM_ORDER}, "ep": parallel_dims.ep,
            "world_size": parallel_dims.world_size}


def _storage(t: Any) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().data_ptr() if isinstance(local, torch.Tensor) else id(local)


def tokenizer_record(tokenizer_path: str) -> dict[str, str] | None:
    """Where the run's tokenizer is, as any working directory reads it, and its contents' hash; None
    when it cannot be read (the run itself then fails on it, not here)."""
    try:
        path = resolve_path(tokenizer_path, "model.tokenizer_path", CheckpointError)
        with open(identifying_file(path), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except (CheckpointError, OSError):
        return None
    return {"path": tokenizer_path if tokenizer_path.startswith(BUNDLED_PREFIX) else os.path.abspath(path),
            "sha256": digest}


class CheckpointManager:
    """Saves the run's states every `checkpoint.interval` steps and at the end; loads the
    resume point. At most one asynchronous save is in flight; `close()` waits for it."""

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims, model_parts: list[nn.Module],
                 optimizers: Stateful, lr_schedulers: Stateful, dataloader: Any, train_state: TrainState,
                 data_shards: int):
        checkpoint = job_config.checkpoint
        self.job_config = job_config
        self.enabled = checkpoint.enable_checkpoint or checkpoint.create_seed_checkpoint
        self.folder = os.path.join(job_config.job.dump_folder, checkpoint.folder)
        self.interval, self.keep_latest_k = checkpoint.interval, checkpoint.keep_latest_k
        self.weights_only_at_end, self.export_dtype = checkpoint.model_weights_only, _DTYPES[checkpoint.export_dtype]
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.layout = _layout(parallel_dims)
        self.parallel_dims = parallel_dims
        self.data_shards = data_shards  # the shard count the data position refers to (DataShards.count)
        self.global_batch = global_batch(job_config.training, parallel_dims.data_parallel_coordinates()[1])
        self.train_state = train_state
        self.model = lora_checkpoint.saved_state(model_parts, job_config)  # a LoRA run's adapters alone, or whole
        self.states: dict[str, Stateful] = {
            "model": self.model,
            "optimizer": optimizers,
            "lr_scheduler": lr_schedulers,
            "dataloader": DataState(dataloader),
            "train_state": train_state,
            "rng": RNGState(self.rank),
        }
        self._in_flight: tuple[Any, str, Manifest, float] | None = None
        self._saves_started = 0  # numbers the background writes, so an agreement names the one it saw
        self._async = None
        if self.enabled and checkpoint.async_mode != "disabled":
            from torchtitan.checkpoint.async_save import AsyncSaver

            self._async = AsyncSaver(checkpoint.async_mode)
        # One name for this job's unfinished saves, the same on every rank.
        self._attempt = decide_on_rank0(lambda: f"{os.getpid()}-{time.time_ns()}")
        self._cleaned = False
        self._record: ModelRecord | None = None
        # What the Hugging Face export writes beside the weights, taken now: the tokenizer file may
        # be gone or changed by the end of a long run.
        self._hf_tokenizer = self._tokenizer_for_export() if checkpoint.last_save_in_hf else None
        self._tokenizer_record = tokenizer_record(tokenizer_source(job_config))

    def model_record(self) -> ModelRecord:
        """This run's model as a manifest records it: name, flavor, args, tied weights (read once
        from the whole model built on the meta device, since a pipeline stage holds one side)."""
        if self._record is None:
            model, args = self.job_config.model, getattr(self.model.model_parts[0], "args", None)
            whole = build_on_meta(get_train_spec(model.name).model_cls, args)
            self._record = ModelRecord(model.name, model.flavor, args_record(args),
                                       tied_aliases(whole) if whole is not None else None,
                                       lora=lora_checkpoint.manifest_record(self.job_config))
        return self._record

    # ----------------------------------------------------------------------------------------
    # Loading

    def load(self, resume: ResumePoint | None) -> None:
        if resume is None:
            return
        # One load, or with LoRA the frozen base and then the adapters (checkpoint/lora.py).
        loads = decide_on_rank0(lambda: lora_checkpoint.loads_for(resume, self.job_config))
        for point, which in loads:
            self._load(point, lora_checkpoint.model_state(self.model.model_parts, which))

    def _load(self, resume: ResumePoint, model: ModelState) -> None:
        """Loads `resume` into this run's states, its model part into `model` (all of the model, or
        a LoRA run's base or adapters)."""
        checkpoint = self.job_config.checkpoint
        if resume.hf:
            self._load_hf(resume.path, model)
            return
        contents = ["model"] if resume.weights_only else list(resume.manifest.contents)
        try:
            metadata = read_metadata(resume.path)
        except Exception as e:  # garbage bytes fail in many ways inside the unpickler
            raise CheckpointError(f"{resume.path} cannot be read safely: its DCP metadata is unreadable "
                                  f"({one_line(e)})") from None
        top_level = not any(key.startswith("model.") for key in metadata.state_dict_metadata)
        states = {name: model if name == "model" else self.states[name] for name in contents
                  if name not in checkpoint.exclude_from_loading}
        left_out = [name for name in contents if name in checkpoint.exclude_from_loading]
        if left_out and self.rank == 0:
            logger.warning(f"not loading {', '.join(left_out)} from {resume.path} (checkpoint.exclude_from_loading): "
                           "they start as in a fresh run")
        if "rng" in states and not self._rng_restorable(resume, metadata):
            logger.info("random generator states not restored: they belong to the ranks of another layout")
            del states["rng"]
        batch_change = resume.batch_change(self.job_config.training, self.parallel_dims.data_parallel_coordinates()[1])
        if batch_change and self.rank == 0:
            logger.warning(batch_change)
        skip = self._check_fits(resume, metadata, states, top_level, model)
        start = time.perf_counter()
        reader, planner = SafeFileSystemReader(resume.path), SafeLoadPlanner()
        try:
            if top_level:  # weights saved by another tool, without our "model." prefix
                model_sd = model.state_dict()
                wanted = {k: v for k, v in model_sd.items() if k not in skip}
                dcp.load(wanted, storage_reader=reader, planner=planner, no_dist=not dist.is_initialized())
                model.load_state_dict({**model_sd, **wanted})
            else:
                wrapped = {name: PartialState(state, name, skip) if skip else state for name, state in states.items()}
                dcp.load(wrapped, storage_reader=reader, planner=planner, no_dist=not dist.is_initialized())
        except CheckpointException as e:  # every rank sees the failure: DCP gathers them
            raise CheckpointError(f"checkpoint {resume.path} cannot be loaded: {one_line(e)}; one of its files is "
                                  "damaged, or was not written by DCP") from None
        seconds = time.perf_counter() - start
        mib_loaded = folders.folder_bytes(resume.path) / 2**20
        loaded = f"loaded {', '.join(states)} from {resume.path} in {seconds:.2f}s ({mib_loaded / seconds:.0f} MiB/s)"
        if resume.weights_only:
            logger.info(loaded)
        else:
            logger.info(f"{loaded}: resuming after step {self.train_state.step} "
                        f"({self.train_state.tokens_seen:,} tokens seen)")

    def _hf_adapter(self) -> tuple[Any, Any]:
        """The model family's HFAdapter and this run's model args. A family without one never gets
        here: preflight refuses checkpoint.last_save_in_hf for it, and find_resume_point a Hugging
        Face folder as checkpoint.initial_load_path, each with its one line."""
        adapter = get_train_spec(self.job_config.model.name).hf_adapter
        assert adapter is not None, "refused before the run starts (preflight.py, resume.py)"
        return adapter, getattr(self.model.model_parts[0], "args", None)

    def _load_hf(self, path: str, model: ModelState) -> None:
        """Model weights from a Hugging Face folder, each rank reading its own shards (hf_training.py)."""
        checkpoint = self.job_config.checkpoint
        adapter, args = self._hf_adapter()
        whole = build_on_meta(get_train_spec(self.job_config.model.name).model_cls, args)
        start = time.perf_counter()
        read = hf_training.load_hf_weights(path, model, adapter, args, hf_training.whole_model_shapes(whole),
                                           list(checkpoint.exclude_from_loading), checkpoint.allow_partial_load)
        seconds = time.perf_counter() - start
        logger.info(f"loaded model weights from the Hugging Face folder {path} in {seconds:.2f}s (this rank read "
                    f"{read / 2**20:.1f} MiB, one parameter at a time)")

    def _tokenizer_for_export(self) -> tuple[dict[str, int | None], dict[str, bytes]]:
        """The special token ids config.json names, and the tokenizer's files (name in the export ->
        contents): tokenizer.model, or a Hugging Face tokenizer's tokenizer.json and config files."""
        job = self.job_config
        tokenizer = get_train_spec(job.model.name).build_tokenizer_fn(job)
        files = {}
        for name, path in tokenizer.files().items():
            with open(path, "rb") as f:
                files[name] = f.read()
        return hf_config_token_ids(tokenizer), files

    def export_if_missing(self, step: int) -> None:
        """The Hugging Face export of a job that has nothing left to train (resumed at its last step)
        but no export of that step yet: checkpoint.last_save_in_hf turned on after the run ended."""
        if self._hf_tokenizer is not None and not os.path.isdir(hf_training.hf_export_path(self.folder, step)):
            self._save_hf(step)

    def _save_hf(self, step: int) -> None:
        """The final weights as a Hugging Face folder beside the checkpoints (checkpoint.last_save_in_hf)."""
        adapter, args = self._hf_adapter()
        ids, tokenizer = self._hf_tokenizer
        try:
            summary = hf_training.write_hf_weights(self.model, adapter, args, self.parallel_dims,
                                                   hf_training.hf_export_path(self.folder, step), self.export_dtype,
                                                   ids, tokenizer, self._attempt)
        except CheckpointSaveError as e:
            if not self.enabled:
                raise
            # The step's own checkpoint was written before the export began: say it is safe.
            raise CheckpointSaveError(f"{e}; the checkpoints in {self.folder} are untouched") from None
        logger.info(summary)

    def _rng_restorable(self, resume: ResumePoint, metadata: Metadata) -> bool:
        """Generator states are per rank: restored only by the layout that wrote them (all ranks
        decide alike, from the manifest and the metadata every rank reads)."""
        keys = flatten("rng", self.states["rng"].state_dict())
        # Checkpoints from before expert parallelism recorded no ep: theirs was 1.
        return {"ep": 1, **resume.manifest.layout} == self.layout and all(k in metadata.state_dict_metadata for k in keys)

    def _check_fits(self, resume: ResumePoint, metadata: Metadata, states: dict[str, Stateful],
                    top_level: bool, model: ModelState) -> set[str]:
        """Refuses, on every rank alike and before any tensor is read, a checkpoint that does not fit
        this run's states (fit.py); returns the keys this rank leaves out of a deliberate partial load."""
        def registered(name: str, flavor: str) -> tuple[Any, Any]:
            spec = get_train_spec(name)
            return spec.model_cls, spec.config[flavor]

        checkpoint, ours = self.job_config.checkpoint, self.model_record()
        exclude = [e for e in checkpoint.exclude_from_loading if e not in self.states]  # whole states are left out in load()
        check = FitCheck(resume.path, metadata, checkpoint_record(resume.manifest, registered), ours, list(states),
                         exclude, checkpoint.allow_partial_load, top_level)
        expected: dict[str, Any] = {}
        for name, state in states.items():
            for key, value in flatten("" if top_level and name == "model" else name, state.state_dict()).items():
                expected[key] = tuple(value.shape) if isinstance(value, torch.Tensor) else None  # DTensor: global
        model_sd = model.state_dict()
        separate = any(alias in model_sd and (source not in model_sd or _storage(model_sd[alias]) != _storage(model_sd[source]))
                       for alias, source in (ours.tied or {}).items())
        mine = check.report(expected, separate)
        plan = check.decide(gather_from_ranks(check.shareable(mine)), mine)
        if self.rank == 0:
            for warning in plan.warnings:
                logger.warning(warning)
        return plan.skip

    # ----------------------------------------------------------------------------------------
    # Saving

    def due(self, step: int, last: bool = False, force: bool = False) -> bool:
        """Whether `save` writes at this step: every `interval`-th, the last, and when forced."""
        hf_export = last and self.job_config.checkpoint.last_save_in_hf
        return bool(self.enabled or hf_export) and (last or force or step % self.interval == 0)

    def save(self, step: int, *, last: bool = False, loss: torch.Tensor | None = None,
             grad_norm: torch.Tensor | None = None, force: bool = False) -> None:
        """Saves at every `interval`-th step, at the last one and when forced (a preemption), unless
        the step's loss or gradient norm is not finite on some rank (such a state never replaces a
        good one)."""
        if not self.due(step, last, force):
            return
        hf_export = last and self.job_config.checkpoint.last_save_in_hf
        if not self._all_finite(loss, grad_norm):
            logger.warning(f"step {step}: the loss or gradient norm is not finite; no checkpoint is saved "
                           f"(the newest good one stays in {self.folder})")
            return
        if self.enabled and last and self.weights_only_at_end:
            self._write(step, {"model": self.model.exported(self.export_dtype)}, dtype=self.export_dtype)
        elif self.enabled:
            self._write(step, self.states)
        if hf_export:
            self._save_hf(step)

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
        self._publish_finished_async_save()  # at most one save in flight
        self._clean_up_unfinished_saves()
        partial = os.path.join(self.folder, folders.partial_name(step, self._attempt))
        record = self.model_record()
        manifest = Manifest(
            step=step, contents=list(states), model={"name": record.name, "flavor": record.flavor},
            model_args=record.args, tied=record.tied,
            layout=self.layout, data_shards=self.data_shards if "dataloader" in states else None,
            global_batch=self.global_batch if "dataloader" in states else None,
            tokens_seen=self.train_state.tokens_seen, dtype=str(dtype).removeprefix("torch.") if dtype else None,
            tokenizer=self._tokenizer_record, lora=lora_checkpoint.manifest_record(self.job_config),
        )
        # Refuses, before any rank writes, a save the disk cannot hold (failures.py).
        planner = SpaceCheckingSavePlanner(partial)
        if self._async is not None:
            self._in_flight = (self._async.save(states, partial, planner), partial, manifest, start)
            self._saves_started += 1
            logger.info(f"step {step}: checkpoint staged, the training loop waited {time.perf_counter() - start:.2f}s; "
                        "the rest is written in the background")
            return
        try:
            dcp.save(states, checkpoint_id=partial, planner=planner, no_dist=not dist.is_initialized())
        except CheckpointException as e:  # raised on every rank alike: DCP gathers the ranks' failures
            self._stop_after_failed_save(step, partial, save_failure(e, self.folder))
        self._publish_on_rank0(partial, manifest, start)

    def _publish_on_rank0(self, partial: str, manifest: Manifest, start: float) -> None:
        """Rank 0 publishes the written save; every rank learns whether that worked, so that a
        failure (a full disk while writing the manifest) stops all of them at the same step."""
        error = None
        if self.rank == 0:
            try:
                self._publish(partial, manifest, start)
            except OSError as e:
                error = save_failure(e, self.folder)
        error = first_error(error)
        if error is not None:
            self._stop_after_failed_save(manifest.step, partial, error)
        if self.rank == 0:
            self._apply_retention()

    def _publish(self, partial: str, manifest: Manifest, start: float) -> None:
        final = os.path.join(self.folder, folders.final_name(manifest.step))
        folders.publish(partial, final, manifest)
        seconds = time.perf_counter() - start
        size = manifest.total_bytes / 2**20
        waited = "the training loop waited all along" if self._async is None else "written in the background"
        logger.info(f"saved checkpoint {final} ({size:.1f} MiB, {', '.join(manifest.contents)}) in {seconds:.2f}s "
                    f"({size / seconds:.0f} MiB/s; {waited})")

    def _apply_retention(self) -> None:
        found, _ = folders.scan(self.folder)
        for old in folders.to_purge(found, self.keep_latest_k):
            try:
                folders.remove(old.path)
            except OSError as e:  # the new checkpoint is safe; an old one left behind costs only space
                logger.warning(f"could not remove {old.path} (checkpoint.keep_latest_k): {one_line(e)}")
                continue
            logger.info(f"removed {old.path} (checkpoint.keep_latest_k {self.keep_latest_k})")

    def _stop_after_failed_save(self, step: int, partial: str, error: str) -> None:
        """Every rank raises here together; rank 0 removes the unfinished folder (only rank 0, so
        that no two ranks race on it), and the earlier checkpoints stay as they are."""
        if self._async is not None:
            self._async.close()  # the background writer has nothing left to do
            self._async = None
        left = ""
        if self.rank == 0 and os.path.exists(partial):
            shutil.rmtree(partial, ignore_errors=True)
            left = f"; {partial} could not be removed" if os.path.exists(partial) else ""
        found, _ = folders.scan(self.folder)
        newest = [f.path for f in found if f.problem is None]
        kept = f"the newest checkpoint stays {newest[-1]}" if newest else "no earlier checkpoint exists"
        raise CheckpointSaveError(f"checkpoint of step {step} not saved: {error}{left}; {kept}")

    def background_save(self) -> tuple[bool, int]:
        """For the ranks' per-step agreement (trainer/agreement.py): whether this rank has nothing
        to publish yet (no background write, or one still running), and which write it is."""
        running = self._in_flight is None or not self._in_flight[0].done()
        return running, self._saves_started

    def publish_if_all_done(self, all_done: bool, save_id: int) -> None:
        """Publishes the background write once every rank agreed it had finished. The ranks agree
        (one step late, without a collective of its own) before any of them publishes, so one whose
        write failed stops together with the others instead of leaving them waiting in the next
        step's collectives. `save_id` makes sure the write agreed on is still the one in flight."""
        if all_done and self._in_flight is not None and save_id == self._saves_started:
            self._publish_finished_async_save()

    def _publish_finished_async_save(self) -> None:
        """Waits for the background write (if any) and publishes it, on every rank together."""
        if self._in_flight is None:
            return
        future, partial, manifest, start = self._in_flight
        self._in_flight = None
        error = None
        try:
            future.result()
        except (CheckpointException, Exception) as e:  # noqa: BLE001 - DCP's exception is a BaseException
            error = save_failure(e, self.folder)
        error = first_error(error)
        if error is not None:
            self._stop_after_failed_save(manifest.step, partial, error)
        self._publish_on_rank0(partial, manifest, start)

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
        self._publish_finished_async_save()
        if self._async is not None:
            self._async.close()
            self._async = None
