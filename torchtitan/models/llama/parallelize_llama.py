"""parallelize_llama: applies parallelisms to a Llama model (or one pipeline stage of it).

Order matters and is fixed: tensor parallelism -> activation checkpointing -> torch.compile ->
FSDP/HSDP or DDP. Each step is one small `apply_*` that logs one line. TP arrives with its own
work; its options are refused by the config until then.
"""

from __future__ import annotations

import inspect
import logging

import torch
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from torchtitan.config_manager import ConfigError, JobConfig
from torchtitan.parallelisms.activation_checkpoint import apply_ac
from torchtitan.parallelisms.distributed import resolve_param_dtype
from torchtitan.parallelisms.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)
_DDP_ARGS = inspect.signature(DistributedDataParallel.__init__).parameters


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    t = job_config.training
    ac = job_config.activation_checkpoint
    if ac.mode != "none":
        apply_ac(model, ac.mode, ac.selective_ac_option)
    if t.compile:
        apply_compile(model)

    if parallel_dims.fsdp_enabled:
        if parallel_dims.dp_replicate_enabled:
            # HSDP: replicate over the outer dim, shard within each replica group.
            fsdp_mesh = parallel_dims.get_mesh("world")[("dp_replicate", "dp_shard")]
        else:
            fsdp_mesh = parallel_dims.get_mesh("dp_shard_cp")
        apply_fsdp(
            model,
            fsdp_mesh,
            param_dtype=resolve_param_dtype(t.mixed_precision_param, fsdp_mesh.device_type),
            reduce_dtype=resolve_param_dtype(t.mixed_precision_reduce, fsdp_mesh.device_type),
            reshard_after_forward=t.fsdp_reshard_after_forward,
            cpu_offload=t.enable_cpu_offload,
        )
    elif parallel_dims.ddp_enabled:
        apply_ddp(
            model,
            parallel_dims.get_mesh("dp_replicate"),
            bucket_cap_mb=t.ddp_bucket_cap_mb,
            reduce_dtype=resolve_param_dtype(t.mixed_precision_reduce, "cpu"),
            compiled=t.compile,
        )
    return model


def apply_compile(model: nn.Module) -> None:
    """Compiles each transformer block on its own (in place, so parameter names do not change).

    Blocks share one code object, so the compiled graph is reused by every block; compiling
    block by block keeps graphs small and lets FSDP / DDP hooks sit between them.
    """
    for block in model.layers.values():
        block.compile(fullgraph=True)
    logger.info(f"compiled {len(model.layers)} transformer blocks with torch.compile")


def apply_ddp(model: nn.Module, mesh: DeviceMesh, bucket_cap_mb: int, reduce_dtype: torch.dtype, compiled: bool) -> None:
    """Replicated data parallelism (DDP) through PyTorch's composable `replicate`.

    Gradients are all-reduced in buckets of `bucket_cap_mb` as backward produces them, so
    communication overlaps the rest of backward.
    """
    if compiled:
        # Dynamo splits compiled graphs at bucket boundaries so the all-reduces still overlap.
        torch._dynamo.config.optimize_ddp = "ddp_optimizer"
    # Buffers (the RoPE table) are computed alike on every rank: no broadcast before each forward.
    no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in _DDP_ARGS
                      else {"broadcast_buffers": False})  # torch < 2.13
    replicate(model, device_mesh=mesh, bucket_cap_mb=bucket_cap_mb, **no_buffer_sync)
    if reduce_dtype == torch.bfloat16:
        if mesh.device_type != "cuda":
            raise ConfigError("training.mixed_precision_reduce bfloat16 under DDP uses PyTorch's bf16 compression hook, "
                              "which needs CUDA and NCCL; on CPU leave it at float32")
        # Halves the all-reduce volume; gradients are cast back to their own dtype afterwards.
        model.register_comm_hook(mesh.get_group(), default_hooks.bf16_compress_hook)
    logger.info(f"applied DDP over mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))} "
                f"(bucket {bucket_cap_mb} MB, reduce {reduce_dtype})")


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str,
    cpu_offload: bool = False,
) -> None:
    """FSDP2 `fully_shard` per transformer block, then at the root (embedding, norm, output)."""
    config = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    if cpu_offload:
        # Pinned host memory makes the host-device copies asynchronous; it needs an accelerator.
        config["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        if reshard_after_forward == "default":
            # The last block's parameters would be gathered again at once for backward, so
            # keeping them after forward saves one all-gather at no extra peak memory.
            reshard = i < len(blocks) - 1
        else:
            reshard = reshard_after_forward == "always"
        fully_shard(block, **config, reshard_after_forward=reshard)
    # The root's parameters (embedding, final norm, output) are used first in backward.
    fully_shard(model, **config, reshard_after_forward=reshard_after_forward == "always")
    kind = "HSDP" if mesh.ndim > 1 else "FSDP"
    offload = "; parameters, gradients and optimizer state offloaded to CPU" if cpu_offload else ""
    logger.info(f"applied {kind} over mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))} (params {param_dtype}, "
                f"reduce {reduce_dtype}, reshard after forward: {reshard_after_forward}{offload})")
