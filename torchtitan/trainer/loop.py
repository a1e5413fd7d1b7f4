"""The training loop as an object. train() (torchtitan/train.py) builds a Trainer from what this rank
trains with and calls run().

A step reads as its numerics, one method each: next_batch, forward_backward, gradient_norm,
agree_to_continue, optimizer_step, log, save, after_step. What watches the step from outside (the
watchdog's phases, the step line's timers, the profilers: instruments.py) is attached around those
methods in the two that sequence them, train_step and end_step, and nowhere else. The other replica
groups of a fault-tolerant job are met through one interface, called every step whatever the mode
(parallelisms/replica_step.py: start_step, draw, average_gradients, commit, after_update), which
does nothing without fault tolerance.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchtitan.checkpoint import CheckpointManager, TrainState
from torchtitan.config.job_config import JobConfig
from torchtitan.errors import Preempted, Stopped, TrainingDiverged
from torchtitan.models import TrainSpec
from torchtitan.observability import host_reads
from torchtitan.observability.goodput import Goodput
from torchtitan.observability.metrics import MetricsLogger, StepMetrics, local_state_bytes
from torchtitan.observability.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from torchtitan.observability.progress import Progress
from torchtitan.observability.setup_record import SetupRecord
from torchtitan.observability.stragglers import SlowLink, SlowRank, Topology, probe_compute, probe_links, slowest_link
from torchtitan.observability.watchdog import Watchdog
from torchtitan.parallelisms import grad_clip
from torchtitan.parallelisms.float8 import precompute_float8_scales
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline_runtime import Pipeline
from torchtitan.parallelisms.replica_step import ReplicaStep
from torchtitan.runtime import collectives, process_group
from torchtitan.runtime.signals import PREEMPTION_SIGNALS, StopRequests
from torchtitan.trainer import step as shared_step
from torchtitan.trainer.agreement import Agreed, Issued, StepAgreement
from torchtitan.trainer.instruments import StepInstruments
from torchtitan.trainer.loss_tokens import StepsWithoutLoss
from torchtitan.trainer.summary import log_summary, newest_checkpoint
from torchtitan.trainer.validation import Validator

logger = logging.getLogger("torchtitan")


@dataclass
class TrainedModel:
    """The model as this rank trains it: its parts (its pipeline stages, with PP), their optimizers
    and LR schedulers, the spec its loss and after-step hook come from, and how its steps meet the
    other replica groups (parallelisms/replica_step.py: nothing to meet without fault tolerance)."""

    train_spec: TrainSpec
    parallel_dims: ParallelDims
    parts: list[nn.Module]
    pipeline: Pipeline | None
    optimizers: Any  # OptimizersContainer (optimizer.py)
    lr_schedulers: Any  # LRSchedulersContainer
    device: torch.device
    replicas: ReplicaStep = field(default_factory=ReplicaStep)


@dataclass
class RunRecords:
    """Where a run's results go besides the model: checkpoints, the step lines and metrics.jsonl,
    the progress and summary, validations, the setup record of what this run applied, and the
    goodput ledger of where its wall clock went (goodput.jsonl)."""

    checkpoint: CheckpointManager
    metrics: MetricsLogger
    progress: Progress
    validator: Validator | None = None
    setup: SetupRecord | None = None
    goodput: Goodput = field(default_factory=Goodput)


@dataclass
class StepResult:
    """What a step leaves to be logged and saved; kept after the step, as the data may run out
    before the next one and the run then ends with this one."""

    step: int
    loss: torch.Tensor  # this rank's own: a pipeline's last stage holds the loss, its other stages zero
    grad_norm: torch.Tensor
    lr: float
    stop_signal: int = 0  # the stop signal some rank received (0: none), as every rank agreed on it
    report: tuple | None = None  # the model's own figures after the step (TrainSpec.after_step_fn)


def global_loss(loss: torch.Tensor, parallel_dims: ParallelDims, pipelined: bool) -> float:
    """A step's loss as the step line and the divergence message give it: summed over the pipeline's
    stages (only the last one holds it), then averaged over the ranks the loss is averaged over."""
    summed = collectives.sum_across(loss, parallel_dims.pp_mesh) if pipelined else loss
    return collectives.mean_across(summed, parallel_dims.loss_mesh)


def source_tokens(dataset: Any, parallel_dims: ParallelDims, device: torch.device) -> dict[str, float]:
    """With a mixture of sources: the training tokens taken from each, over all data-parallel ranks."""
    counts = dataset.tokens_by_source() if hasattr(dataset, "tokens_by_source") else {}
    if len(counts) < 2:
        return {}
    total = collectives.sum_across(torch.tensor(list(counts.values()), dtype=torch.float64, device=device),
                               parallel_dims.data_mesh)
    return dict(zip(counts, total.tolist()))


class Trainer:
    """Trains one rank's model parts from its data to training.steps, with checkpoints, step lines,
    validation and the run's summary. `watchdog`: this rank's (watchdog.py); `stops`: the stop
    signals, installed when the first step starts; `eos_id`: the end-of-text id documents are masked
    at (training.document_mask), else None."""

    def __init__(self, job_config: JobConfig, model: TrainedModel, dataloader: Any, train_state: TrainState,
                 records: RunRecords, watchdog: Watchdog, stops: StopRequests | None = None,
                 eos_id: int | None = None):
        self.job_config, self.training = job_config, job_config.training
        self.train_spec, self.parallel_dims, self.device = model.train_spec, model.parallel_dims, model.device
        self.model_parts, self.pipeline = model.parts, model.pipeline
        self.optimizers, self.lr_schedulers = model.optimizers, model.lr_schedulers
        self.replicas = model.replicas
        self.dataloader, self.train_state, self.eos_id = dataloader, train_state, eos_id
        self.checkpoint, self.metrics, self.progress = records.checkpoint, records.metrics, records.progress
        self.validator, self.setup, self.goodput = records.validator, records.setup, records.goodput
        self.watchdog, self.stops = watchdog, stops
        self.tokens_before = train_state.tokens_seen  # the summary counts this run's own tokens
        self.first_step = train_state.step + 1  # of this run: 1, or the step after a resumed checkpoint's
        self.newest: StepResult | None = None  # the newest step this run trained
        self.logged = self.validated = 0  # the last step logged, and validated
        _, self.dp_degree = model.parallel_dims.data_parallel_coordinates()
        self.params: list[nn.Parameter] = []  # what the gradient norm is over (the loop lists them)
        self.data_iter: Any = None  # and the instruments: from the first step on
        self.instruments: StepInstruments | None = None
        self.agreement = StepAgreement(model.device, self.training.on_nonfinite_loss == "stop")
        self.pending: Issued | None = None  # the agreement of a step not read yet (agree_to_continue)
        self.without_loss = StepsWithoutLoss(self.train_spec.loss_fn)  # read at the step lines
        self.topology: Topology | None = None  # where the ranks run, found at the first step line
        optimizer = job_config.optimizer
        # PyTorch's fused Adam/AdamW skip an update on the device when told (found_inf); with the
        # parameters in host memory (CPU offload) the flag would have to come to the host first.
        self.skips_on_device = (optimizer.fused and not optimizer.early_step_in_backward
                                and not self.training.enable_cpu_offload)

    # ------------------------------------------------------------------------------------------
    # The run

    def run(self) -> None:
        """Trains what is left, then waits for the checkpoint still being written and logs the
        summary. A stop or a divergence ends every rank after the same step."""
        try:
            ended = self.train_what_is_left()
            with self.goodput.counting("checkpoint_save"):
                self.checkpoint.close()  # waits for a save still being written in the background
            self.summarize(ended)
        except (Stopped, TrainingDiverged) as e:
            # Every rank ends here after the same step, so the save still in flight can finish: the
            # newest good checkpoint is kept and named in the run's last line.
            with self.goodput.counting("checkpoint_save"):
                self.checkpoint.close()
            if isinstance(e, Stopped) and e.step is not None:
                self.summarize("stopped")
            e.add_context(newest_checkpoint(self.job_config))
            raise
        finally:
            self.metrics.close()
            self.goodput.close()
            self.replicas.close()

    def train_what_is_left(self) -> str:
        """Validates a resumed step that missed its validation, then trains up to training.steps,
        inside the profilers when they are on; returns how training ended ("done", "data ran out")."""
        step, validator = self.train_state.step, self.validator
        if validator is not None and step > 0 and (validator.due(step) or step >= self.training.steps):
            # A run stopped right after saving a step due for validation (a preemption) never
            # validated it; nor did a run validated only later (validation turned on afterwards).
            self.validate_if_missing(step)
        if step >= self.training.steps:
            logger.info(f"nothing left to train: the checkpoint resumed from is at step {step} and "
                        f"training.steps is {self.training.steps} (raise training.steps to train further)")
            self.checkpoint.export_if_missing(step)
            return "done"
        rank = process_group.rank()
        audit = os.path.join(self.job_config.job.dump_folder, "host_reads", f"rank{rank}.json")
        with maybe_enable_profiling(self.job_config, rank, step) as profiler, \
                maybe_enable_memory_snapshot(self.job_config, rank, step) as memory_snapshot, \
                host_reads.maybe_audit(self.job_config.profiling.audit_host_reads, audit, self.first_step, logger.info):
            self.data_iter = iter(self.dataloader)
            self.instruments = StepInstruments(self.watchdog, self.first_step, profiler, memory_snapshot, self.goodput)
            return self.train_loop()

    def train_loop(self) -> str:
        """Trains up to training.steps; returns how the loop ended ("done", or "data ran out")."""
        self.params = [p for part in self.model_parts for p in part.parameters()]
        # Collection pauses of Python's GC differ per rank and stall collectives; collect on a schedule.
        gc.disable()
        gc.collect(1)
        logger.info(f"training {self.training.steps} steps from step {self.train_state.step}, global batch "
                    f"{self.training.batch_size * self.dp_degree * self.training.gradient_accumulation_steps} x {self.training.seq_len} tokens")
        if self.stops is not None:
            self.stops.install()  # from here on, SIGINT and SIGTERM stop every rank after the same step
        while self.train_state.step < self.training.steps:
            if not self.train_step():
                return "data ran out"
        return "done"

    # ------------------------------------------------------------------------------------------
    # One step: its numerics, in the order train_step calls them

    def train_step(self) -> bool:
        """One step, each of its phases marked and timed from outside its numerics; False when the
        data ran out before it (the last step trained is then ended as the run's last)."""
        mark, replicas = self.instruments, self.replicas
        replicas.start_step()  # fault-tolerant HSDP: the replica groups' quorum, found during forward
        with mark.phase("data loading", self.train_state.step + 1):
            with mark.own_time(loading_data=True):
                micro_batches = replicas.draw(self.next_batch)
            ran_out = self.data_ran_out(micro_batches)
        if ran_out:
            self.settle_pending()  # the step trained last is the run's last: read its agreement first
            self.end_step(self.newest, last=True, ran_out=True)
            return False
        mark.count_tokens(micro_batches)
        step = self.begin_step()
        with mark.phase("forward/backward"):
            loss = self.forward_backward(micro_batches)
        with mark.phase("averaging across replica groups"):
            replicas.average_gradients(self.params)
        with mark.phase("gradient norm"):
            grad_norm = self.gradient_norm()
        with mark.phase("agreeing to go on"):
            stop_signal, found_inf = self.agree_to_continue(step, loss, grad_norm)
            if not replicas.commit():  # too few groups, or one failed: the step is tried again
                self.train_state.step -= 1
                return True
            step = self.train_state.step  # a group that recovered this step took the peers' count
        with mark.phase("optimizer step"):
            with mark.own_time():
                self.optimizer_step(found_inf)
            lr = self.finish_update()
        with mark.phase("averaging across replica groups"):
            if not replicas.after_update(step):  # semi-synchronous: a sync not committed, back to the last one
                return True
            step = self.train_state.step  # a group that recovered at this sync took the peers' count
        result = self.newest = StepResult(step, loss, grad_norm, lr, stop_signal)
        last = step == self.training.steps
        logged = self.log_due(result, last)
        with mark.phase("after step"), host_reads.scheduled_read() if logged else contextlib.nullcontext():
            result.report = self.after_step(result, logged)  # the model's figures are read for the step line only
        self.end_step(result, last)
        return True

    def next_batch(self) -> list:
        """The step's micro-batches, one per gradient accumulation step (None where the data ran out)."""
        return [next(self.data_iter, None) for _ in range(self.training.gradient_accumulation_steps)]

    def data_ran_out(self, micro_batches: list) -> bool:
        # Every rank stops at the same step, even if only one rank's shards ran out; the last step
        # trained is logged, validated and saved as the last step of a run is.
        ran_out = not self.training.dataset_infinite and collectives.any_rank(any(b is None for b in micro_batches))
        if ran_out:
            logger.info(f"the data ran out after step {self.train_state.step}; training ends there "
                        "(training.dataset_infinite is false)")
        return ran_out

    def begin_step(self) -> int:
        self.train_state.step += 1
        step = self.train_state.step
        if step % self.training.gc_freq == 0:
            gc.collect(1)
        self.optimizers.zero_grad()
        return step

    def forward_backward(self, micro_batches: list) -> torch.Tensor:
        """The step's forwards and backwards; returns this rank's loss."""
        loss = shared_step.forward_backward(self.train_spec, self.parallel_dims, self.model_parts, self.pipeline,
                                            micro_batches, self.device, self.training.defer_sharded_gradient_reduction,
                                            self.eos_id)
        tied = self.pipeline.tied if self.pipeline is not None else None
        if tied is not None:
            tied.reduce_grads()  # a weight shared by the first and last stage gets both stages' gradients
        return loss

    def gradient_norm(self) -> torch.Tensor:
        """The gradients' norm over the whole model, the gradients clipped to training.max_norm."""
        if self.job_config.optimizer.early_step_in_backward:
            return self.optimizers.grad_norm()  # the hooks measured, applied and freed every gradient in backward
        tied = self.pipeline.tied if self.pipeline is not None else None
        return grad_clip.clip_grad_norm_(self.params, self.training.max_norm, self.parallel_dims.pp_mesh,
                                       uncounted=tied.uncounted if tied is not None else ())

    def agree_to_continue(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """Once per step the ranks agree on whether to go on (trainer/agreement.py): a stop signal
        seen by any rank, a non-finite loss or gradient norm on any rank (raised, before any later
        step is applied: the model and every checkpoint stay good), and whether the background
        checkpoint write has finished everywhere. The agreement is issued now and read during the
        next step, unless this step reads on the host anyway (it logs, saves or validates, or is
        the last) or the optimizer cannot skip a non-finite step on the device. Returns the stop
        signal agreed (0: none) and the device flag that skips this step's update (None: not needed)."""
        issued = self.agreement.issue(step, self.stops.requested if self.stops else 0, self.checkpoint.background_save(),
                                      loss, grad_norm)
        earlier, self.pending = self.pending, None
        stop_signal = self.act_on(self.agreement.read(earlier, deferred=True)) if earlier is not None else 0
        if self.settles_every_step:
            stop_signal = max(stop_signal, self.act_on(self.agreement.read(issued, deferred=False)))
        elif self.reads_anyway(step, stop_signal):
            with host_reads.scheduled_read():
                stop_signal = max(stop_signal, self.act_on(self.agreement.read(issued, deferred=False)))
        else:
            self.pending = issued
        return stop_signal, issued.found_inf if self.skips_on_device else None

    @property
    def settles_every_step(self) -> bool:
        """Whether every step must read its agreement before its update: the update was applied in
        backward, is committed across replica groups this step, or cannot be skipped on the device."""
        return (self.job_config.optimizer.early_step_in_backward or self.replicas.settles_every_step
                or (self.training.on_nonfinite_loss == "stop" and not self.skips_on_device))

    def reads_anyway(self, step: int, stop_signal: int) -> bool:
        """Whether this step reads on the host anyway (it logs, saves or validates, or is the last),
        so its agreement is read at once and the step ends exactly as it would have."""
        last = step == self.training.steps
        return (last or self.log_due_at(step, stop_signal, last)
                or self.checkpoint.due(step, last, force=self.preempted_at(step, stop_signal))
                or (self.validator is not None and self.validator.due(step)))

    def settle_pending(self) -> int:
        """Reads the agreement still pending (before the run ends with the step it was for)."""
        earlier, self.pending = self.pending, None
        return self.act_on(self.agreement.read(earlier, deferred=False)) if earlier is not None else 0

    def act_on(self, agreed: Agreed) -> int:
        """Raises for a non-finite step; publishes the background checkpoint write every rank
        finished; returns the stop signal."""
        if agreed.nonfinite:
            loss_value = global_loss(agreed.loss, self.parallel_dims, self.pipeline is not None)
            applied = ("was applied in backward (optimizer.early_step_in_backward) but is in no checkpoint"
                       if self.job_config.optimizer.early_step_in_backward else "was not applied")
            raise TrainingDiverged(f"non-finite loss at step {agreed.step} (loss {loss_value:.4g}, gradient norm "
                                   f"{agreed.grad_norm.item():.4g}); the step {applied}; lower optimizer.lr or raise "
                                   "training.warmup_steps, then resume")
        with host_reads.scheduled_read():  # once per background save: its publishing agrees across ranks
            self.checkpoint.publish_if_all_done(agreed.saves_done, agreed.save_id)
        return agreed.stop_signal

    def optimizer_step(self, found_inf: torch.Tensor | None = None) -> None:
        """The update; `found_inf` (on the device) skips it inside the fused kernel when set."""
        self.optimizers.step(found_inf)

    def finish_update(self) -> float:
        """What follows the parameter update: float8 scales for FSDP's next all-gather, the LR
        schedule and the token count. Returns the learning rate the step used."""
        lr = self.lr_schedulers.get_last_lr()
        if self.job_config.float8.precompute_float8_dynamic_scale_for_fsdp:
            precompute_float8_scales(self.model_parts)
        self.lr_schedulers.step()
        training = self.training
        self.train_state.tokens_seen += (training.batch_size * training.seq_len * training.gradient_accumulation_steps
                                         * self.dp_degree)
        return lr

    def after_step(self, result: StepResult, logged: bool) -> tuple | None:
        """The model's own after-step work (e.g. MoE routing biases), returning its figures for the
        step line; after the run's first step, the setup record (optimizer state exists now)."""
        report = None
        if self.train_spec.after_step_fn is not None:
            report = self.train_spec.after_step_fn(self.model_parts, self.parallel_dims, log=logged)
        if self.setup is not None and result.step == self.setup.first_step:
            # What this run applied and loaded, with every rank's state bytes.
            self.setup.write(self.metrics, self.parallel_dims, self.model_parts, self.optimizers, self.pipeline)
        return report

    # ------------------------------------------------------------------------------------------
    # The tail every step ends with

    def end_step(self, result: StepResult | None, last: bool, ran_out: bool = False) -> None:
        """Logs, saves and validates the step as due. When the data ran out (`ran_out`) it ends the
        last step trained once more, as the run's last (`result` None: none was trained): the line,
        checkpoint and validation its own tail left for a later step are done now."""
        mark, step = self.instruments, self.train_state.step
        # What follows reads on the host only on the steps it serves (the host-read audit's "scheduled").
        with mark.phase("logging", step):
            if self.log_due(result, last):
                with host_reads.scheduled_read():
                    self.log(result)
                self.goodput.note(step)  # goodput.jsonl's row of this log step
        with mark.phase("checkpoint save", step):
            due = self.checkpoint.due(step, last, force=self.preempted(result))
            with host_reads.scheduled_read() if due else contextlib.nullcontext():
                self.save(step, result, last)
        if due:  # goodput.jsonl: how far the job had come at a step a later attempt may resume from
            self.goodput.note(step)
        if not ran_out:  # the step's own tail
            mark.step_done()  # the profiler's and the memory snapshot's step
            self.stop_if_agreed(result)
        if self.validation_due(result, last):
            # A stop abandons a validation, since the step after it stops the run; none follows the last.
            with host_reads.scheduled_read():
                self.validate_in_run(step, None if ran_out else self.stops)
        if not ran_out:
            self.progress.step_done(step)
            if step == self.first_step:
                mark.first_step_done(self.job_config.comm.train_timeout_seconds)
                self.log_state_bytes()

    def log_due(self, result: StepResult | None, last: bool) -> bool:
        if result is None or self.logged >= result.step:
            return False
        return self.log_due_at(result.step, result.stop_signal, last)

    def log_due_at(self, step: int, stop_signal: int, last: bool) -> bool:
        # The last step before a stop is logged too, so a resumed run's metrics have no gap. This
        # run's first step (1, or the one after a resumed checkpoint's) has a line of its own: it
        # pays for compilation and warm-up, which the summary's steady state leaves out.
        return (last or bool(stop_signal) or step in (1, self.first_step)
                or step % self.job_config.metrics.log_freq == 0)

    def validation_due(self, result: StepResult | None, last: bool) -> bool:
        if self.validator is None or result is None or self.validated >= result.step:
            return False
        return last or self.validator.due(result.step)

    def log(self, result: StepResult) -> None:
        """One step line (console, TensorBoard, metrics.jsonl) over the steps since the last one."""
        pd, window = self.parallel_dims, self.instruments.window
        loss_value = global_loss(result.loss, pd, self.pipeline is not None)
        bubble = self.pipeline.bubble_since_last_call(pd.pp_mesh) if self.pipeline is not None else None
        elapsed = self.instruments.window_seconds()
        # Ranks of one tp/cp/pp group process the same tokens, each doing its share of the work:
        # per device, every token counts once per group (so MFU compares with one device's peak).
        tokens = window.tokens / pd.non_data_parallel_size
        steps = result.step - window.first_step + 1
        stragglers = collectives.slowest_and_median(window.own_seconds / steps)
        where, compute, link = self.locate(stragglers)
        values, summary = result.report or ({}, "")
        replica_values, replica_text = self.replicas.step_line()  # with replica groups, those in this step
        if replica_text:
            values, summary = {**values, **replica_values}, f"{summary}  {replica_text}".strip()
        self.metrics.log(StepMetrics(result.step, loss_value, result.grad_norm.item(), result.lr, tokens, elapsed,
                                     window.data_seconds, bubble, values, summary, own_seconds=stragglers,
                                     slowest_where=where, slow_compute=compute, slow_link=link,
                                     steps=steps, total_steps=self.training.steps, progress=self.progress.text(result.step),
                                     source_tokens=source_tokens(self.dataloader.dataset, pd, result.loss.device)))
        self.without_loss.read(window.first_step, result.step)
        window.restart(result.step + 1)
        self.logged = result.step

    def locate(self, stragglers: tuple[int, float, float] | None) -> tuple[str, SlowRank | None, SlowLink | None]:
        """On several nodes: where the slowest rank runs, and the compute and link probes' slowest
        (observability/stragglers.py; collectives, on log steps, which every rank logs alike)."""
        if stragglers is None:
            return "", None, None
        if self.topology is None:
            self.topology = Topology.of_this_job()
        if self.topology is None or self.topology.nodes < 2:
            return "", None, None
        return (self.topology.describe(stragglers[0]), probe_compute(self.topology, self.device),
                slowest_link(self.topology, *probe_links(self.topology)))

    def preempted(self, result: StepResult | None) -> bool:
        return result is not None and self.preempted_at(result.step, result.stop_signal)

    def preempted_at(self, step: int, stop_signal: int) -> bool:
        """SIGTERM or SIGUSR1 (preemption, a time limit coming): the step all ranks agreed on is saved."""
        return stop_signal in PREEMPTION_SIGNALS and step < self.training.steps and self.checkpoint.enabled

    def save(self, step: int, result: StepResult | None, last: bool) -> None:
        """The checkpoint, when due; the step's own loss and gradient norm keep a non-finite state
        out of it (on any rank: the checkpoint manager agrees on that across ranks)."""
        self.checkpoint.save(step, last=last, loss=result.loss if result is not None else None,
                             grad_norm=result.grad_norm if result is not None else None, force=self.preempted(result))

    def stop_if_agreed(self, result: StepResult) -> None:
        if result.stop_signal and result.step < self.training.steps:
            raise (Preempted if self.preempted(result) else Stopped)(result.stop_signal, result.step)

    def log_state_bytes(self) -> None:
        param_bytes, optim_bytes = local_state_bytes(self.model_parts, self.optimizers.optimizers)
        logger.info(f"rank {process_group.rank()} holds parameters {param_bytes / 2**20:.3f} MiB, "
                    f"optimizer state {optim_bytes / 2**20:.3f} MiB")

    # ------------------------------------------------------------------------------------------
    # Validation and the summary

    def validate(self, step: int, stops: StopRequests | None = None) -> float | None:
        """Validates the model after `step` and logs it; returns the seconds it took, None when a stop
        was requested meanwhile (the training loop then stops after its next step)."""
        result = self.validator.run(step, stops, self.watchdog)
        if result is None:
            return None
        self.goodput.add("validation", result.seconds)
        self.metrics.log_validation(result.step, result.loss, result.perplexity, result.batches, result.tokens,
                                    result.seconds)
        return result.seconds

    def validate_in_run(self, step: int, stops: StopRequests | None) -> None:
        """A validation between steps: its time is kept out of training's throughput and pace."""
        seconds = self.validate(step, stops)
        self.validated = step
        if seconds is not None:
            self.instruments.leave_out(seconds)
            self.progress.validation_done(seconds)

    def validate_if_missing(self, step: int) -> None:
        """Validates `step` unless metrics.jsonl already has its validation (read by rank 0, which
        decides for every rank: validation is collective)."""
        missing = collectives.max_across_ranks([process_group.rank() == 0 and step not in self.metrics.validations])[0]
        if missing:
            self.validate(step)

    def summarize(self, ended: str) -> None:
        self.replicas.log_summary()
        log_summary(self.job_config, self.metrics, self.progress, self.train_state.step,
                    self.train_state.tokens_seen - self.tokens_before, ended, self.without_loss.total, self.goodput)
