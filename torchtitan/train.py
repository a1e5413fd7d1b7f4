# ruff: noqa: E402 - the imports follow the SIGINT set-up below, on purpose
"""Entry point: `python -m torchtitan.train [--section.key value ...]` on every rank (torchrun).

Reads as the build sequence: config -> mesh -> data -> meta model -> parallelize -> materialise
-> optimizer -> checkpoint -> the Trainer (trainer/loop.py), which runs the loop. Everything
model-specific comes from the model's TrainSpec.
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

# First of the package: its clock starts before the imports below (torch's), which start-up counts.
from torchtitan.observability.goodput import Goodput

# isort: split
import gc
import logging
import sys
import warnings
from typing import Any

import torch

from torchtitan.checkpoint import CheckpointManager, ResumePoint, TrainState, find_resume_point
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import help_text, parse_args
from torchtitan.config.preflight import preflight
from torchtitan.datasets.shards import DataShards, decide_data_shards
from torchtitan.errors import Stopped, UserError
from torchtitan.estimation.dry_run import estimate_before_training
from torchtitan.estimation.dry_run import main as dry_run_main
from torchtitan.models import TrainSpec
from torchtitan.observability.logging import init_logger
from torchtitan.observability.metrics import MetricsLogger
from torchtitan.observability.progress import Progress
from torchtitan.observability.setup_record import SetupRecord
from torchtitan.observability.watchdog import collective_timeout, watch_this_rank
from torchtitan.parallelisms.fault_tolerance import join_replica_groups
from torchtitan.parallelisms.mixed_precision import compute_dtype
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.replica_step import data_coordinates, empty_ledger, replica_dump_folder
from torchtitan.parallelisms.semi_sync import join_semi_sync
from torchtitan.runtime import device_setup, process_group
from torchtitan.runtime.reports import attempt, mark_attempt, reporting_to_folder, say_how_it_ended
from torchtitan.runtime.signals import PREEMPTION_SIGNALS, StopRequests
from torchtitan.trainer.loop import RunRecords, TrainedModel, Trainer
from torchtitan.trainer.step import build_model_parts, document_mask_eos, loss_context, with_training_loss
from torchtitan.trainer.validation import ValidatedModel, Validator

logger = logging.getLogger("torchtitan")

DEFAULT_SEED = 0
# DTensor's CPU random ops initialise each shard from the same generator state, so a sharded CPU
# init differs from a single-process one; runs that must match start from a seed checkpoint
# (docs/parity.md), which makes this warning noise.
warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support on cpu")
# DCP says so whenever a single process saves or loads, which is how a one-process run works.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def train(job_config: JobConfig, stops: StopRequests | None = None) -> None:
    """This rank's part of the job: the build sequence, then the Trainer's run (trainer/loop.py)."""
    goodput = Goodput.of_this_process()  # where the wall clock goes, phase by phase (observability/goodput.py)
    training = job_config.training
    job_config.job.dump_folder = replica_dump_folder(job_config)  # fault tolerance: each group its own
    # Everything that can be checked without a process group is checked first, on every rank.
    parallel_dims, plan, train_spec, tokenizer, model_args, model = preflight(job_config, process_group.world_size())
    if job_config.memory_estimation.enabled:
        estimate_before_training(job_config)  # this rank's peak, before any process group (estimation/dry_run.py)
    goodput.mark("preflight")
    device_type = device_setup.device_type()
    device = process_group.init_distributed(device_type, collective_timeout(job_config.comm.init_timeout_seconds),
                                            job_config.comm.trace_buf_size, job_config.job.dump_folder)
    goodput.mark("process_group")
    # From here on a rank that stops making progress is named within the timeout (watchdog.py).
    with watch_this_rank(process_group.rank(), process_group.world_size(), job_config.job.dump_folder,
                         job_config.comm.init_timeout_seconds) as watchdog:
        parallel_dims.build_mesh(device_type)
        goodput.mark("mesh")
        device_setup.set_determinism(DEFAULT_SEED if training.seed < 0 else training.seed, training.deterministic)
        describe_job(job_config)
        resume = None if job_config.checkpoint.create_seed_checkpoint else find_resume_point(job_config)
        dataloader, shards = build_dataloader(job_config, train_spec, tokenizer, parallel_dims, resume)

        # Model: built on the meta device (no memory) by preflight, parallelized, then materialised per rank.
        n_params, flops_per_token = describe_model(job_config, model, model_args)
        train_spec = with_training_loss(train_spec, job_config, parallel_dims, device_type)  # chunked, or compiled on CUDA
        model_parts, pipeline = build_model_parts(job_config, train_spec, parallel_dims, plan, model, model_args, device)
        del model
        optimizers = train_spec.build_optimizers_fn(model_parts, job_config, parallel_dims)
        lr_schedulers = train_spec.build_lr_schedulers_fn(optimizers, job_config)
        train_state = TrainState(data_consumed=empty_ledger(job_config))
        checkpoint = CheckpointManager(job_config, parallel_dims, model_parts, optimizers, lr_schedulers, dataloader,
                                       train_state, shards.count)
        if job_config.checkpoint.create_seed_checkpoint:
            return save_seed_checkpoint(checkpoint)
        goodput.mark("model_build")  # data, model, optimizer
        checkpoint.load(resume)
        goodput.mark("checkpoint_load")
        groups = join_replica_groups(job_config, model_parts, optimizers, lr_schedulers, train_state, dataloader, device)
        trained = TrainedModel(train_spec, parallel_dims, model_parts, pipeline, optimizers, lr_schedulers, device,
                               join_semi_sync(groups, model_parts, lr_schedulers, train_state))
        setup = SetupRecord(job_config, model_args, n_params, resume, train_state.step, shards.count, goodput)
        metrics = MetricsLogger(job_config, device, flops_per_token, process_group.rank(), compute_dtype(training, device_type),
                                resumed_step=train_state.step, goodput=goodput)
        validator = build_validator(job_config, trained, tokenizer, shards)
        progress = Progress(training.steps, train_state.step + 1, job_config.validation.freq if validator else 0, start=goodput.created)
        records = RunRecords(checkpoint, metrics, progress, validator, setup, goodput)
        Trainer(job_config, trained, dataloader, train_state, records, watchdog, stops,
                eos_id=document_mask_eos(job_config, tokenizer)).run()


def build_dataloader(job_config: JobConfig, train_spec: TrainSpec, tokenizer: Any, parallel_dims: ParallelDims,
                     resume: ResumePoint | None) -> tuple[Any, DataShards]:
    """This rank's training data and the shards it reads: each data-parallel rank reads its own
    share; tp/cp/pp peers read the same. A resumed run reads the data in as many shards as its
    checkpoint's data position refers to."""
    training = job_config.training
    dp_rank, dp_degree = data_coordinates(job_config, *parallel_dims.data_parallel_coordinates())
    if attempt():
        logger.warning(f"restart {attempt()} of this job (torchrun, MAX_RESTARTS): "
                       + (f"resuming from {resume.path}" if resume is not None else "starting from step 0 again, as "
                          "there is no checkpoint to resume from (checkpoint.enable_checkpoint)"))
    resumed_shards = resume.data_shards(training.dataset_shards, dp_degree) if resume is not None else None
    shards = decide_data_shards(training.dataset_shards, dp_rank, dp_degree, resumed_shards)
    return train_spec.build_dataloader_fn(job_config, tokenizer, shards), shards


def describe_job(job_config: JobConfig) -> None:
    """Logs the job's description, and its whole configuration with job.print_args."""
    logger.info(f"job: {job_config.job.description}")
    if job_config.job.print_args:
        logger.info(f"job config: {job_config.to_dict()}")


def save_seed_checkpoint(checkpoint: CheckpointManager) -> None:
    """With checkpoint.create_seed_checkpoint: step-0 of the freshly initialised weights, and no training."""
    checkpoint.save_seed()
    logger.info("seed checkpoint written; exiting")


def describe_model(job_config: JobConfig, model: torch.nn.Module, model_args: Any) -> tuple[int, int]:
    """Logs the model's size; returns its parameter count and its training FLOPs per token."""
    n_params = sum(p.numel() for p in model.parameters())
    flops_per_token = model.flops_per_token(job_config.training.seq_len)
    padded = f" (+{model_args.vocab_padding} padding)" if getattr(model_args, "vocab_padding", 0) else ""
    logger.info(f"model {job_config.model.name} {job_config.model.flavor}: {n_params:,} parameters, "
                f"vocab {model_args.vocab_size}{padded}")
    return n_params, flops_per_token


def build_validator(job_config: JobConfig, trained: TrainedModel, tokenizer: Any,
                    shards: DataShards) -> Validator | None:
    if not job_config.validation.enabled:
        return None
    model = ValidatedModel(trained.parallel_dims, trained.parts, trained.pipeline, trained.device,
                           trained.train_spec.loss_fn, loss_context(trained.parallel_dims))
    return Validator(job_config, trained.train_spec.build_validation_dataloader_fn, tokenizer, model, shards)


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
    if process_group.world_size() == 1:
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, _interrupt)
    process_group.die_with_launcher()
    mark_attempt()
    stops = StopRequests(process_group.rank())  # takes over both signals when the training loop starts
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
        code = say_how_it_ended(process_group.rank(), e, stops.requested)
        if isinstance(e, Stopped) and e.step is not None and reporting_to_folder():
            # Every rank agreed to stop after this step. The launcher exits with the report's code
            # (75, 130, ...); torchrun would take a rank's non-zero code for a failure and, with
            # MAX_RESTARTS, start the job again instead of letting it stop.
            code = 0
    finally:
        stops.uninstall()
        for sig, handler in previous.items():  # a caller running main() in-process gets its own back
            signal.signal(sig, handler)
        process_group.shutdown(clean)
    return code


if __name__ == "__main__":
    code = main()
    if process_group.world_size() > 1:
        process_group.exit_process(code)
    sys.exit(code)
