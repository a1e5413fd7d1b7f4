# ruff: noqa: E402 - the imports follow the SIGINT set-up below, on purpose
"""Entry point: `python -m torchtitan.train [--section.key value ...]` on every rank (torchrun).

Reads as the build sequence: config -> mesh -> data -> meta model -> parallelize -> materialise
-> optimizer -> checkpoint -> loop. Everything model-specific comes from the model's TrainSpec.
"""

from __future__ import annotations

import signal

if __name__ == "__main__":
    # Ctrl-C while torch is being imported ends the process quietly instead of with an import
    # traceback; main() gives Python's own handler back.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
elif __name__ == "__mp_main__":
    # A helper process a rank started with multiprocessing's spawn (DCP's checkpoint writer), which
    # shares the rank's process group and so the launcher's Ctrl-C or SIGTERM. It must finish the
    # save in flight; its rank decides when to stop, and ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

import contextlib
import gc
import logging
import os
import sys
import time
import warnings
from typing import Any, Iterator

import torch
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan import watchdog
from torchtitan.checkpoint import CheckpointManager, TrainState, find_resume_point
from torchtitan.checkpoint import folders as checkpoint_folders
from torchtitan.checkpoint.hf_training import hf_export_path
from torchtitan.config_manager import help_text, parse_args
from torchtitan.datasets.shards import decide_data_shards
from torchtitan.errors import (
    PREEMPTION_SIGNALS,
    Preempted,
    Stopped,
    StopRequests,
    TrainingDiverged,
    UserError,
    attempt,
    mark_attempt,
    reporting_to_folder,
    say_how_it_ended,
)
from torchtitan.estimation.dry_run import estimate_before_training
from torchtitan.estimation.dry_run import main as dry_run_main
from torchtitan.job_config import JobConfig
from torchtitan.logging import init_logger
from torchtitan.metrics import LogWindow, MetricsLogger, StepMetrics, local_state_bytes
from torchtitan.parallelisms import distributed as tt_dist
from torchtitan.parallelisms.float8 import precompute_float8_scales
from torchtitan.parallelisms.mixed_precision import compute_dtype
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline_runtime import Pipeline
from torchtitan.preflight import preflight
from torchtitan.profiling import MemorySnapshot, maybe_enable_memory_snapshot, maybe_enable_profiling
from torchtitan.progress import Progress, summary
from torchtitan.setup_record import SetupRecord
from torchtitan.step import build_model_parts, document_mask_eos, forward_backward, with_compiled_loss
from torchtitan.validation import Validator

logger = logging.getLogger("torchtitan")

DEFAULT_SEED = 0
# DTensor's CPU random ops initialise each shard from the same generator state, so a sharded CPU
# init differs from a single-process one; runs that must match start from a seed checkpoint
# (docs/parity.md), which makes this warning noise.
warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support on cpu")
# DCP says so whenever a single process saves or loads, which is how a one-process run works.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def train(job_config: JobConfig, stops: StopRequests | None = None) -> None:
    started = time.perf_counter()
    t = job_config.training
    # Everything that can be checked without a process group is checked first, on every rank.
    parallel_dims, plan, train_spec, tokenizer, model_args, model = preflight(job_config, tt_dist.world_size())
    if job_config.memory_estimation.enabled:
        estimate_before_training(job_config)  # this rank's peak, before any process group (estimation/dry_run.py)
    device_type = tt_dist.device_type()
    c = job_config.comm
    device = tt_dist.init_distributed(device_type, watchdog.collective_timeout(c.init_timeout_seconds),
                                      c.trace_buf_size, job_config.job.dump_folder)
    # From here on a rank that stops making progress is named within the timeout (watchdog.py).
    watchdog.start(tt_dist.rank(), tt_dist.world_size(), job_config.job.dump_folder, c.init_timeout_seconds)
    parallel_dims.build_mesh(device_type)
    tt_dist.set_determinism(DEFAULT_SEED if t.seed < 0 else t.seed, t.deterministic)
    logger.info(f"job: {job_config.job.description}")
    if job_config.job.print_args:
        logger.info(f"job config: {job_config.to_dict()}")

    # Data: each data-parallel rank reads its own share; tp/cp/pp peers read the same. A resumed
    # run reads the data in as many shards as its checkpoint's data position refers to.
    dp_rank, dp_degree = parallel_dims.data_parallel_coordinates()
    resume = None if job_config.checkpoint.create_seed_checkpoint else find_resume_point(job_config)
    if attempt():
        logger.warning(f"restart {attempt()} of this job (torchrun, MAX_RESTARTS): "
                       + (f"resuming from {resume.path}" if resume is not None else "starting from step 0 again, as "
                          "there is no checkpoint to resume from (checkpoint.enable_checkpoint)"))
    resumed_shards = resume.data_shards(t.dataset_shards, dp_degree) if resume is not None else None
    shards = decide_data_shards(t.dataset_shards, dp_rank, dp_degree, resumed_shards)
    dataloader = train_spec.build_dataloader_fn(job_config, tokenizer, shards)

    # Model: built on the meta device (no memory) by preflight, parallelized, then materialised per rank.
    n_params = sum(p.numel() for p in model.parameters())
    flops_per_token = model.flops_per_token(t.seq_len)
    padded = f" (+{model_args.vocab_padding} padding)" if getattr(model_args, "vocab_padding", 0) else ""
    logger.info(f"model {job_config.model.name} {job_config.model.flavor}: {n_params:,} parameters, "
                f"vocab {model_args.vocab_size}{padded}")
    train_spec = with_compiled_loss(train_spec, job_config, parallel_dims, device_type)  # fused, compile on CUDA
    model_parts, pipeline = build_model_parts(job_config, train_spec, parallel_dims, plan, model, model_args, device)
    del model

    optimizers = train_spec.build_optimizers_fn(model_parts, job_config, parallel_dims)
    lr_schedulers = train_spec.build_lr_schedulers_fn(optimizers, job_config)
    train_state = TrainState()
    checkpoint = CheckpointManager(job_config, parallel_dims, model_parts, optimizers, lr_schedulers, dataloader,
                                   train_state, shards.count)
    if job_config.checkpoint.create_seed_checkpoint:
        checkpoint.save_seed()
        logger.info("seed checkpoint written; exiting")
        return
    checkpoint.load(resume)
    setup = SetupRecord(job_config, model_args, n_params, resume, train_state.step, shards.count)

    metrics = MetricsLogger(job_config, device, flops_per_token, tt_dist.rank(), compute_dtype(t, device_type),
                            resumed_step=train_state.step)
    validator = None
    if job_config.validation.enabled:
        loss_context = loss_parallel if parallel_dims.loss_parallel_enabled else contextlib.nullcontext
        validator = Validator(job_config, train_spec.build_validation_dataloader_fn, tokenizer, parallel_dims,
                              model_parts, train_spec.loss_fn, loss_context, pipeline, device, shards)
    progress = Progress(t.steps, train_state.step + 1, job_config.validation.freq if validator else 0, start=started)
    tokens_before = train_state.tokens_seen
    try:
        if validator is not None and train_state.step > 0 and (validator.due(train_state.step)
                                                               or train_state.step >= t.steps):
            # A run stopped right after saving a step due for validation (a preemption) never
            # validated it; nor did a run validated only later (validation turned on afterwards).
            validate_if_missing(validator, metrics, train_state.step)
        if train_state.step >= t.steps:
            logger.info(f"nothing left to train: the checkpoint resumed from is at step {train_state.step} and "
                        f"training.steps is {t.steps} (raise training.steps to train further)")
            checkpoint.export_if_missing(train_state.step)
            ended = "done"
        else:
            with maybe_enable_profiling(job_config, tt_dist.rank(), train_state.step) as profiler, \
                    maybe_enable_memory_snapshot(job_config, tt_dist.rank(), train_state.step) as memory_snapshot:
                ended = train_loop(job_config, train_spec, parallel_dims, model_parts, optimizers, lr_schedulers,
                                   iter(dataloader), train_state, checkpoint, metrics, device, dp_degree, profiler,
                                   pipeline, stops, setup, validator, progress, dataloader.dataset,
                                   eos_id=document_mask_eos(job_config, tokenizer), memory_snapshot=memory_snapshot)
        checkpoint.close()  # waits for a save still being written in the background
        log_summary(job_config, metrics, progress, train_state, tokens_before, ended)
    except (Stopped, TrainingDiverged) as e:
        # Every rank ends here after the same step, so the save still in flight can finish: the
        # newest good checkpoint is kept and named in the run's last line.
        checkpoint.close()
        if isinstance(e, Stopped) and e.step is not None:
            log_summary(job_config, metrics, progress, train_state, tokens_before, ended="stopped")
        e.add_context(newest_checkpoint(job_config))
        raise
    finally:
        metrics.close()


def log_summary(job_config: JobConfig, metrics: MetricsLogger, progress: Progress, train_state: TrainState,
                tokens_before: int, ended: str = "done") -> None:
    """The run's closing lines on the console and its summary row in metrics.jsonl."""
    if train_state.step < progress.first_step:  # no step ran (the data ran out at once)
        return
    dump, m = job_config.job.dump_folder, job_config.metrics
    outputs = {}
    c = job_config.checkpoint
    if c.enable_checkpoint:
        outputs["checkpoints"] = newest_checkpoint(job_config).removeprefix("newest checkpoint: ")
    hf_export = hf_export_path(os.path.join(dump, c.folder), train_state.step)
    if c.last_save_in_hf and os.path.isdir(hf_export):
        outputs["Hugging Face weights"] = hf_export
    if m.save_jsonl:
        outputs["metrics"] = os.path.join(dump, "metrics.jsonl")
    if m.enable_tensorboard:
        outputs["TensorBoard"] = os.path.join(dump, m.save_tb_folder)
    lines, record = summary(progress, train_state.step, train_state.tokens_seen - tokens_before,
                            *metrics.mean_throughput(), metrics.validations, outputs, ended)
    for line in lines:
        logger.info(line)
    metrics.log_record(record)


def newest_checkpoint(job_config: JobConfig) -> str:
    if not job_config.checkpoint.enable_checkpoint:
        return "checkpointing is off (checkpoint.enable_checkpoint)"
    found, _ = checkpoint_folders.scan(os.path.join(job_config.job.dump_folder, job_config.checkpoint.folder))
    complete = [f for f in found if f.problem is None]
    return f"newest checkpoint: {complete[-1].path}" if complete else "no checkpoint saved yet"


def train_loop(job_config, train_spec, parallel_dims, model_parts, optimizers, lr_schedulers,
               data_iter: Iterator, train_state: TrainState, checkpoint: CheckpointManager,
               metrics: MetricsLogger, device: torch.device, dp_degree: int, profiler=None,
               pipeline: Pipeline | None = None, stops: StopRequests | None = None,
               setup: SetupRecord | None = None, validator: Validator | None = None,
               progress: Progress | None = None, dataset: Any = None, eos_id: int | None = None,
               memory_snapshot: MemorySnapshot | None = None) -> str:
    """Trains up to training.steps; returns how the loop ended ("done", or "data ran out").
    `eos_id`: the end-of-text id documents are masked at (training.document_mask), else None."""
    t = job_config.training
    accum = t.gradient_accumulation_steps
    params = [p for part in model_parts for p in part.parameters()]
    loss_mesh, pp_mesh = parallel_dims.loss_mesh, parallel_dims.pp_mesh
    # Collection pauses of Python's GC differ per rank and stall collectives; collect on a schedule.
    gc.disable()
    gc.collect(1)
    first_step = train_state.step + 1  # of this run: 1, or the step after a resumed checkpoint's
    window = LogWindow(first_step)
    step_loss = grad_norm = lr = report = None
    logged = validated = 0  # the last step logged, and validated
    logger.info(f"training {t.steps} steps from step {train_state.step}, global batch "
                f"{t.batch_size * dp_degree * accum} x {t.seq_len} tokens")
    if stops is not None:
        stops.install()  # from here on, SIGINT and SIGTERM stop every rank after the same step
    while train_state.step < t.steps:
        watchdog.enter("data loading", train_state.step + 1)
        data_start = time.perf_counter()
        micro_batches = [next(data_iter, None) for _ in range(accum)]
        window.data_seconds += time.perf_counter() - data_start
        window.own_seconds += time.perf_counter() - data_start
        if not t.dataset_infinite and tt_dist.any_rank(any(b is None for b in micro_batches)):
            # Every rank stops at the same step, even if only one rank's shards ran out; the last
            # step trained is logged, validated and saved as the last step of a run is.
            logger.info(f"the data ran out after step {train_state.step}; training ends there "
                        "(training.dataset_infinite is false)")
            if step_loss is not None and logged < train_state.step:
                log_step(job_config, parallel_dims, metrics, pipeline, progress, window, train_state.step, step_loss,
                         grad_norm, lr, report, dataset)
            checkpoint.save(train_state.step, last=True, loss=step_loss, grad_norm=grad_norm)
            if validator is not None and step_loss is not None and validated < train_state.step:
                validate(validator, metrics, progress, window, train_state.step)
            return "data ran out"
        train_state.step += 1
        step = train_state.step
        if step % t.gc_freq == 0:
            gc.collect(1)
        optimizers.zero_grad()
        watchdog.enter("forward/backward")
        step_loss = forward_backward(train_spec, parallel_dims, model_parts, pipeline, micro_batches, device, window,
                                     t.defer_sharded_gradient_reduction, eos_id)
        tied = pipeline.tied if pipeline is not None else None
        if tied is not None:
            tied.reduce_grads()  # a weight shared by the first and last stage gets both stages' gradients
        in_backward = job_config.optimizer.early_step_in_backward
        watchdog.enter("gradient norm")
        if in_backward:  # the hooks measured, applied and freed every gradient during backward
            grad_norm = optimizers.grad_norm()
        else:
            grad_norm = tt_dist.clip_grad_norm_(params, t.max_norm, pp_mesh,
                                                uncounted=tied.uncounted if tied is not None else ())
        # Once per step the ranks agree on whether to go on: a stop signal seen by any rank, a
        # non-finite loss or gradient norm on any rank (checked before the step is applied, so the
        # model and every checkpoint stay good).
        nonfinite = t.on_nonfinite_loss == "stop" and not bool(
            (torch.isfinite(grad_norm) & torch.isfinite(step_loss)).item())
        watchdog.enter("agreeing to go on")
        stop_signal, diverged = tt_dist.max_across_ranks([stops.requested if stops else 0, nonfinite])
        stop_signal = int(stop_signal)
        if diverged:
            loss_value = tt_dist.mean_across(tt_dist.sum_across(step_loss, pp_mesh) if pipeline else step_loss,
                                             loss_mesh)
            applied = ("was applied in backward (optimizer.early_step_in_backward) but is in no checkpoint"
                       if in_backward else "was not applied")
            raise TrainingDiverged(f"non-finite loss at step {step} (loss {loss_value:.4g}, gradient norm "
                                   f"{grad_norm.item():.4g}); the step {applied}; lower optimizer.lr or raise "
                                   "training.warmup_steps, then resume")
        lr = lr_schedulers.get_last_lr()
        watchdog.enter("optimizer step")
        optimizer_start = time.perf_counter()
        optimizers.step()
        window.own_seconds += time.perf_counter() - optimizer_start
        if job_config.float8.precompute_float8_dynamic_scale_for_fsdp:
            precompute_float8_scales(model_parts)
        lr_schedulers.step()
        train_state.tokens_seen += t.batch_size * t.seq_len * accum * dp_degree
        # The last step before a stop is logged too, so a resumed run's metrics have no gap.
        log_this_step = step == 1 or step % job_config.metrics.log_freq == 0 or step == t.steps or bool(stop_signal)
        watchdog.enter("logging")
        report = None
        if train_spec.after_step_fn is not None:  # e.g. MoE routing biases and statistics
            report = train_spec.after_step_fn(model_parts, parallel_dims, log=log_this_step)

        if setup is not None and step == setup.first_step:
            # What this run applied and loaded, with every rank's state bytes (optimizer state exists now).
            setup.write(metrics, parallel_dims, model_parts, optimizers, pipeline)
        if log_this_step:
            step_loss = log_step(job_config, parallel_dims, metrics, pipeline, progress, window, step, step_loss,
                                 grad_norm, lr, report, dataset)
            logged = step
        # SIGTERM or SIGUSR1 (preemption, a time limit coming) saves the step all ranks agreed on.
        preempted = stop_signal in PREEMPTION_SIGNALS and step < t.steps and checkpoint.enabled
        watchdog.enter("checkpoint save")
        checkpoint.save(step, last=step == t.steps, loss=step_loss, grad_norm=grad_norm, force=preempted)
        if profiler is not None:
            profiler.step()
        if memory_snapshot is not None:
            memory_snapshot.step()
        if stop_signal and step < t.steps:
            raise (Preempted if preempted else Stopped)(stop_signal, step)
        if validator is not None and validator.due(step):
            validate(validator, metrics, progress, window, step, stops)
            validated = step
        if progress is not None:
            progress.step_done(step)
        if step == first_step:  # a resumed run too: its first step is its slow one
            watchdog.set_limit(job_config.comm.train_timeout_seconds)
            tt_dist.set_timeout(watchdog.collective_timeout(job_config.comm.train_timeout_seconds))
            param_bytes, optim_bytes = local_state_bytes(model_parts, optimizers.optimizers)
            logger.info(f"rank {tt_dist.rank()} holds parameters {param_bytes / 2**20:.3f} MiB, "
                        f"optimizer state {optim_bytes / 2**20:.3f} MiB")
    return "done"


def validate_if_missing(validator: Validator, metrics: MetricsLogger, step: int) -> None:
    """Validates `step` unless metrics.jsonl already has its validation (read by rank 0, which
    decides for every rank: validation is collective)."""
    missing = tt_dist.max_across_ranks([tt_dist.rank() == 0 and step not in metrics.validations])[0]
    if missing:
        validate(validator, metrics, None, None, step)


def log_step(job_config: JobConfig, parallel_dims: ParallelDims, metrics: MetricsLogger, pipeline: Pipeline | None,
             progress: Progress | None, window: LogWindow, step: int, step_loss: torch.Tensor, grad_norm: torch.Tensor,
             lr: float, report: tuple | None, dataset: Any = None) -> torch.Tensor:
    """One step line (console, TensorBoard, metrics.jsonl) over the steps since the last one; returns
    the step's loss as every rank holds it afterwards (summed over the pipeline's stages)."""
    pp_mesh = parallel_dims.pp_mesh
    if pipeline is not None:
        # Only the last stage has a loss; the others contribute zero to the sum over pp.
        step_loss = tt_dist.sum_across(step_loss, pp_mesh)
    loss_value = tt_dist.mean_across(step_loss, parallel_dims.loss_mesh)
    bubble = pipeline.bubble_since_last_call(pp_mesh) if pipeline is not None else None
    elapsed = time.perf_counter() - window.start
    # Ranks of one tp/cp/pp group process the same tokens, each doing its share of the work:
    # per device, every token counts once per group (so MFU compares with one device's peak).
    tokens = window.tokens / parallel_dims.non_data_parallel_size
    steps = step - window.first_step + 1
    stragglers = tt_dist.slowest_and_median(window.own_seconds / steps)
    metrics.log(StepMetrics(step, loss_value, grad_norm.item(), lr, tokens, elapsed, window.data_seconds, bubble,
                            *(report or ()), own_seconds=stragglers, steps=steps,
                            total_steps=job_config.training.steps,
                            progress=progress.text(step) if progress is not None else "",
                            source_tokens=source_tokens(dataset, parallel_dims, step_loss.device)))
    window.restart(step + 1)
    return step_loss


def source_tokens(dataset: Any, parallel_dims: ParallelDims, device: torch.device) -> dict[str, float]:
    """With a mixture of sources: the training tokens taken from each, over all data-parallel ranks."""
    counts = dataset.tokens_by_source() if hasattr(dataset, "tokens_by_source") else {}
    if len(counts) < 2:
        return {}
    total = tt_dist.sum_across(torch.tensor(list(counts.values()), dtype=torch.float64, device=device),
                               parallel_dims.data_mesh)
    return dict(zip(counts, total.tolist()))


def validate(validator: Validator, metrics: MetricsLogger, progress: Progress | None, window: LogWindow | None,
             step: int, stops: StopRequests | None = None) -> None:
    """Validates after `step` and logs it; its time is kept out of training's throughput and pace."""
    result = validator.run(step, stops)
    if result is None:  # a stop was requested meanwhile: the training loop stops after its next step
        return
    metrics.log_validation(result.step, result.loss, result.perplexity, result.batches, result.tokens, result.seconds)
    if window is not None:
        window.start += result.seconds
    if progress is not None:
        progress.validation_done(result.seconds)


class _StartUpInterrupted(KeyboardInterrupt):
    def __init__(self, signum: int):
        super().__init__(signum)  # args, so that it pickles like any exception
        self.signum = signum


def _interrupt(signum: int, frame) -> None:
    raise _StartUpInterrupted(signum)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    init_logger()
    # What the imports made lives as long as the process: out of every collection from here on,
    # so the full one at shutdown (and each scheduled one) walks only what the run itself made.
    gc.freeze()
    # Until training starts there is nothing to keep: Ctrl-C interrupts at once, and so do SIGTERM
    # and SIGUSR1 for a single process. A rank of a larger job keeps their default (end now),
    # because that is how the launcher tears down ranks waiting for a peer that already failed.
    previous = {sig: signal.getsignal(sig) for sig in StopRequests.SIGNALS}
    signal.signal(signal.SIGINT, _interrupt)
    if tt_dist.world_size() == 1:
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, _interrupt)
    tt_dist.die_with_launcher()
    mark_attempt()
    stops = StopRequests(tt_dist.rank())  # takes over both signals when the training loop starts
    code, clean = 0, False
    try:
        job_config = parse_args(argv)
        if job_config.job.dry_run:
            dry_run_main(job_config)  # one process standing for a rank of any world (estimation/dry_run.py)
        else:
            train(job_config, stops)
        clean = True
    except BaseException as e:  # noqa: BLE001 - every ending gets its one line or its one traceback
        if isinstance(e, FileNotFoundError):
            e = UserError(str(e))
        elif isinstance(e, KeyboardInterrupt) and not stops.installed:
            e = Stopped(getattr(e, "signum", signal.SIGINT), None)
        code = say_how_it_ended(tt_dist.rank(), e, stops.requested)
        if isinstance(e, Stopped) and e.step is not None and reporting_to_folder():
            # Every rank agreed to stop after this step. The launcher exits with the report's code
            # (75, 130, ...); torchrun would take a rank's non-zero code for a failure and, with
            # MAX_RESTARTS, start the job again instead of letting it stop.
            code = 0
    finally:
        watchdog.stop()
        stops.uninstall()
        for sig, handler in previous.items():  # a caller running main() in-process gets its own back
            signal.signal(sig, handler)
        tt_dist.shutdown(clean)
    return code


if __name__ == "__main__":
    code = main()
    if tt_dist.world_size() > 1:
        tt_dist.exit_process(code)
    sys.exit(code)
