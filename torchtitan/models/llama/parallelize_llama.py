"""parallelize_llama: applies parallelisms to a Llama model (or one pipeline stage of it).

Order matters and is fixed: tensor parallelism -> activation checkpointing -> torch.compile ->
FSDP/HSDP. Each step is one small `apply_*` that logs one line. TP, compile and DDP arrive with
their own work; their options are refused by the config until then.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from torchtitan.config_manager import JobConfig
from torchtitan.parallelisms.distributed import resolve_param_dtype
from torchtitan.parallelisms.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    ac = job_config.activation_checkpoint
    if ac.mode != "none":
        apply_ac(model, ac.mode, ac.selective_ac_option)

    if parallel_dims.fsdp_enabled:
        t = job_config.training
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
    return model


def apply_ac(model: nn.Module, mode: str, selective_ac_option: str) -> None:
    """Wraps transformer blocks so their activations are recomputed in backward.

    full: every block. selective with integer k: every k-th block (block index % k == 0),
    trading compute for memory in between the two extremes. The choice depends only on the
    block's own index, so it needs no counter and is the same whatever the pipeline split.
    """
    every = 1 if mode == "full" else int(selective_ac_option)
    wrapped = 0
    for name, block in list(model.layers.named_children()):
        if int(name) % every == 0:
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
            wrapped += 1
    logger.info(f"applied {mode} activation checkpointing to {wrapped} of {len(model.layers)} blocks")


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
        config["offload_policy"] = CPUOffloadPolicy()
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
    logger.info(f"applied {kind} over mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))} (params {param_dtype}, reduce {reduce_dtype})")
