"""How a run ends on the console and in metrics.jsonl: its closing lines, its summary row, and the
newest checkpoint that the last line names."""

from __future__ import annotations

import logging
import os

from torchtitan.checkpoint import folders as checkpoint_folders
from torchtitan.checkpoint.hf_training import hf_export_path
from torchtitan.config.job_config import JobConfig
from torchtitan.observability.goodput import Goodput
from torchtitan.observability.metric_files import MetricsFile
from torchtitan.observability.metrics import MetricsLogger
from torchtitan.observability.progress import Progress, summary

logger = logging.getLogger("torchtitan")


def log_summary(job_config: JobConfig, metrics: MetricsLogger, progress: Progress, last_step: int, tokens: int,
                ended: str = "done", steps_without_loss: int = 0, goodput: Goodput | None = None) -> None:
    """The run's closing lines on the console and its summary row in metrics.jsonl. `tokens`: the
    training tokens this run took (a resumed run's own); `steps_without_loss`: its steps in which no
    label carried a loss (trainer/loss_tokens.py); `goodput`: the run's ledger, whose lines (this
    run's, and the job's after earlier attempts) follow the first line."""
    if last_step < progress.first_step:  # no step ran (the data ran out at once)
        return
    dump, metrics_options = job_config.job.dump_folder, job_config.metrics
    outputs = {}
    checkpoint = job_config.checkpoint
    if checkpoint.enable_checkpoint:
        outputs["checkpoints"] = newest_checkpoint(job_config).removeprefix("newest checkpoint: ")
    hf_export = hf_export_path(os.path.join(dump, checkpoint.folder), last_step)
    if checkpoint.last_save_in_hf and os.path.isdir(hf_export):
        outputs["Hugging Face weights"] = hf_export
    if metrics_options.save_jsonl:
        outputs["metrics"] = os.path.join(dump, "metrics.jsonl") + _stopped(metrics.jsonl)
    if metrics_options.enable_tensorboard:
        outputs["TensorBoard"] = os.path.join(dump, metrics_options.save_tb_folder) + _stopped(metrics.writer)
    lines, record = summary(progress, last_step, tokens, *metrics.mean_throughput(), metrics.validations, outputs,
                            ended, metrics.steady_throughput())
    if steps_without_loss:
        lines.insert(1, f"steps without a label that carries a loss: {steps_without_loss} of {record['steps']} "
                        "(they trained nothing)")
        record["steps_without_loss"] = steps_without_loss
    if goodput is not None:
        goodput_lines, goodput_fields = goodput.summary(last_step, ended)
        lines[1:1] = goodput_lines
        record.update(goodput_fields)
    for line in lines:
        logger.info(line)
    metrics.log_record(record)


def _stopped(file: MetricsFile | None) -> str:
    """Why a metrics file holds less than the run logged (a failed write stopped it), if it does."""
    return f" (not written since a failed write {file.stopped})" if file is not None and file.stopped else ""


def newest_checkpoint(job_config: JobConfig) -> str:
    if not job_config.checkpoint.enable_checkpoint:
        return "checkpointing is off (checkpoint.enable_checkpoint)"
    found, _ = checkpoint_folders.scan(os.path.join(job_config.job.dump_folder, job_config.checkpoint.folder))
    complete = [f for f in found if f.problem is None]
    return f"newest checkpoint: {complete[-1].path}" if complete else "no checkpoint saved yet"
