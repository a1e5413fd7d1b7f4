"""DeepSeek-V3's work after each optimizer step: the MoE layers' (routing biases, expert-load
statistics; torchtitan/parallelisms/expert_parallel.py) plus the multi-token prediction loss on
logging steps."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.models.train_spec import StepReport
from torchtitan.observability import host_reads
from torchtitan.parallelisms.expert_parallel import moe_after_step
from torchtitan.parallelisms.parallel_dims import ParallelDims


def deepseek_v3_after_step(model_parts: list[nn.Module], parallel_dims: ParallelDims, *,
                           log: bool) -> StepReport | None:
    """A TrainSpec AfterStepFn. The MTP loss is kept by the last pipeline stage's model part; every
    rank adds what it holds (zero elsewhere) over the world and divides by the ranks of one stage:
    each rank of the loss mesh holds its part of the mean over the loss mesh's targets, times the
    mesh's size (the model's `loss_ranks`; context-parallel ranks hold parts of the same sequences),
    and tensor-parallel ranks the same value, so the result is that mean, over every sequence of
    the step."""
    report = moe_after_step(model_parts, parallel_dims, log=log)
    with_mtp = [p for p in model_parts if getattr(p, "args", None) is not None and p.args.mtp_depth > 0]
    held = [p.take_mtp_loss() for p in with_mtp if p.mtp is not None]  # reset every step
    if not log or not with_mtp:
        return report
    total = torch.stack(held).sum() if held else torch.zeros((), device=with_mtp[0].rope_cache.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
        total = total / (dist.get_world_size() // parallel_dims.pp)
    values, summary = report if report is not None else ({}, "")
    with host_reads.scheduled_read():  # a logging step's read
        mtp = total.item()
    values = {**values, "mtp_loss": mtp}
    return StepReport(values, f"{summary}  mtp: {mtp:.4f}".strip())

