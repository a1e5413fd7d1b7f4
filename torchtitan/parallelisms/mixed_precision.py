"""Mixed precision for every layout: the model computes in `training.mixed_precision_param`
(`auto`: bf16 on CUDA, fp32 on CPU) while parameters, gradients and optimizer state stay fp32.

Two mechanisms, one rule. Where FSDP shards the model, its MixedPrecisionPolicy casts the
gathered parameters to bf16 (data_parallel.apply_fsdp). Everywhere else (one device, DDP, TP or PP
without FSDP, their combinations) each model part's forward runs under `torch.autocast`: matmuls
and attention in bf16, norms, softmax and the loss in fp32 (the loss upcasts its logits itself),
and the fp32 residual stream stays fp32. Both leave fp32 master weights for the optimizer, and
gradients reach their reductions in fp32.

Autocast wraps each part's own forward, not the training step, so it covers pipeline stages
(whose schedule calls the stage modules), validation and generation alike, and never wraps
backward (autograd replays the forward's dtypes; activation checkpointing restores the autocast
state when it recomputes).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
from torch import nn

from torchtitan.config.job_config import Training
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.runtime.torch_compat import ops as torch_compat_ops

logger = logging.getLogger(__name__)


def resolve_param_dtype(name: str, device_type: str) -> torch.dtype:
    """A config dtype name as a torch dtype; `auto` computes in bf16 on CUDA (tensor cores) and in
    fp32 on CPU, where fp32 is the reference precision for parity tests."""
    if name == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def compute_dtype(training: Training, device_type: str) -> torch.dtype:
    """The dtype the model's matmuls run in, for every layout (MFU counts against its peak)."""
    return resolve_param_dtype(training.mixed_precision_param, device_type)


def uses_autocast(training: Training, parallel_dims: ParallelDims, device_type: str) -> bool:
    """Whether the parts' forwards run under autocast: lower precision asked for and no FSDP to cast."""
    return compute_dtype(training, device_type) != torch.float32 and not parallel_dims.fsdp_enabled


def apply_mixed_precision(model_parts: list[nn.Module], parallel_dims: ParallelDims, training: Training,
                          device_type: str) -> None:
    """Makes this rank's model parts compute in the configured dtype where FSDP does not already."""
    if not uses_autocast(training, parallel_dims, device_type):
        return  # fp32, or FSDP's MixedPrecisionPolicy casts the parameters (data_parallel.apply_fsdp)
    dtype = compute_dtype(training, device_type)
    for part in model_parts:
        part.forward = _autocast_forward(part.forward, device_type, dtype)
    logger.info(f"mixed precision: forward under torch.autocast({device_type}, {dtype}), fp32 parameters, "
                "gradients and optimizer state")


def warn_if_emulated(training: Training, device_type: str) -> None:
    """One warning where bf16 is asked of a CPU that can only emulate it (called by the preflight
    with the device the job runs on, so a dry run standing for GPUs does not warn)."""
    if device_type == "cpu" and compute_dtype(training, device_type) != torch.float32 and not cpu_has_bf16_matmul():
        logger.warning("training.mixed_precision_param bfloat16: this CPU has no bf16 matrix instructions "
                       "(AVX512-BF16 or AMX), so bf16 matmuls are emulated, far slower than fp32")


def _autocast_forward(forward: Callable, device_type: str, dtype: torch.dtype) -> Callable:
    # A fresh autocast context per call: one shared instance would keep the state of an outer call.
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    run.autocast_dtype = dtype
    return run


def autocast_dtype(part: nn.Module) -> torch.dtype | None:
    """The dtype a part's forward autocasts to (apply_mixed_precision), None where it does not."""
    return getattr(part.forward, "autocast_dtype", None)


@functools.cache
def cpu_has_bf16_matmul() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU (AVX512-BF16 or AMX); without, PyTorch
    emulates them (measured on an AVX2-only EPYC: about 100x slower than fp32)."""
    try:
        return torch_compat_ops.onednn_has_bf16()
    except (AttributeError, RuntimeError):
        return False
