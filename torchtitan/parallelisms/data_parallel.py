"""Data parallelism for any model family: FSDP2 / HSDP, DDP, or FSDP-based replication.

Which one applies, and over which mesh, follows from `ParallelDims` alone (its role meshes), so
every model's parallelize function calls `apply_data_parallel` last and decides nothing itself.
The model only has to keep its transformer blocks in `model.layers` (each block is wrapped on
its own, then the root); a model with more block-like modules (DeepSeek-V3's multi-token
prediction modules) names them all as `blocks`, in forward order.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from torchtitan.config.job_config import Training
from torchtitan.errors import ConfigError
from torchtitan.parallelisms.ddp_reduction import apply_same_layout_reduction
from torchtitan.parallelisms.mixed_precision import resolve_param_dtype
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.runtime.torch_compat import compile as torch_compat_compile
from torchtitan.runtime.torch_compat import composable as torch_compat_composable
from torchtitan.runtime.torch_compat.composable import replicate

logger = logging.getLogger(__name__)
_DDP_ARGS = inspect.signature(DistributedDataParallel.__init__).parameters


@dataclass(frozen=True)
class FSDPUnit:
    """A submodule that FSDP wraps on its own, before its block: over another mesh than the
    block's (parameters shared by other ranks, e.g. experts under expert parallelism), with
    gradients divided by `divide_factor` instead of that mesh's size."""

    module: nn.Module
    mesh: DeviceMesh
    divide_factor: int


def apply_data_parallel(model: nn.Module, parallel_dims: ParallelDims, training: Training,
                        units: Sequence[FSDPUnit] = (), blocks: Sequence[nn.Module] | None = None) -> None:
    """FSDP / HSDP when anything shards parameters (dp_shard or cp > 1), else DDP over the replicas.

    Replicas of a model that tensor or pipeline parallelism already touched use PyTorch's
    FSDP-based `replicate`, because the composable DDP does not accept DTensor parameters.
    `units` are wrapped first, each over its own mesh (also on layouts without FSDP otherwise).
    `blocks`: the modules wrapped one by one before the root, in forward order (default
    `model.layers`' blocks).
    """
    blocks = list(model.layers.values()) if blocks is None else list(blocks)
    if units:
        _apply_fsdp_units(units, parallel_dims, training)
    if parallel_dims.fsdp_enabled:
        mesh = parallel_dims.fsdp_mesh
        apply_fsdp(
            model,
            mesh,
            param_dtype=resolve_param_dtype(training.mixed_precision_param, mesh.device_type),
            reduce_dtype=resolve_param_dtype(training.mixed_precision_reduce, mesh.device_type),
            # A pipeline stage runs forward once per microbatch before its backwards: freeing the
            # gathered parameters after each forward would gather them again every microbatch.
            reshard_after_forward=("never" if parallel_dims.pp_enabled and training.fsdp_reshard_after_forward == "default"
                                   else training.fsdp_reshard_after_forward),
            cpu_offload=training.enable_cpu_offload,
            blocks=blocks,
        )
    elif parallel_dims.ddp_enabled and (parallel_dims.tp_enabled or parallel_dims.pp_enabled):
        apply_fsdp_replicate(model, parallel_dims.replicate_mesh,
                             reduce_dtype=resolve_param_dtype(training.mixed_precision_reduce, "cpu"), blocks=blocks)
    elif parallel_dims.ddp_enabled:
        apply_ddp(model, parallel_dims.replicate_mesh, bucket_cap_mb=training.ddp_bucket_cap_mb,
                  reduce_dtype=resolve_param_dtype(training.mixed_precision_reduce, "cpu"), compiled=training.compile)


def _apply_fsdp_units(units: Sequence[FSDPUnit], parallel_dims: ParallelDims, training: Training) -> None:
    device_type = units[0].mesh.device_type
    # The same precision as the rest of the model: FSDP's policy where FSDP shards the model, fp32 otherwise.
    param_dtype = resolve_param_dtype(training.mixed_precision_param, device_type) if parallel_dims.fsdp_enabled else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=param_dtype,
                                  reduce_dtype=resolve_param_dtype(training.mixed_precision_reduce, device_type))
    config = {"mp_policy": policy}
    if training.enable_cpu_offload:
        config["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type != "cpu")
    reshard = not parallel_dims.pp_enabled and training.fsdp_reshard_after_forward != "never"
    for unit in units:
        fully_shard(unit.module, mesh=unit.mesh, reshard_after_forward=reshard, **config)
        unit.module.set_gradient_divide_factor(unit.divide_factor)
        if device_type == "cpu" and unit.mesh.shape[-1] > 1:
            # A custom factor becomes a pre-multiplied sum, which gloo lacks: sum, then divide.
            # (Not over a single shard: PyTorch 2.13 would then divide twice.)
            unit.module.set_force_sum_reduction_for_comms(True)
    meshes = sorted({_mesh_text(u.mesh) for u in units})
    logger.info(f"applied FSDP to {len(units)} submodules over their own meshes ({', '.join(meshes)}; gradients "
                f"divided by {sorted({u.divide_factor for u in units})})")


def _mesh_text(mesh: DeviceMesh) -> str:
    return str(dict(zip(mesh.mesh_dim_names, mesh.shape)))


def apply_ddp(model: nn.Module, mesh: DeviceMesh, bucket_cap_mb: int, reduce_dtype: torch.dtype, compiled: bool) -> None:
    """Replicated data parallelism (DDP) through PyTorch's composable `replicate`.

    Gradients are all-reduced in buckets of `bucket_cap_mb` as backward produces them, so
    communication overlaps the rest of backward; over more than two ranks, every step in the
    same bucket layout (ddp_reduction.py), so that a resumed run repeats the uninterrupted one.
    """
    if compiled:
        # Dynamo splits compiled graphs at bucket boundaries so the all-reduces still overlap.
        torch_compat_compile.split_graphs_at_ddp_buckets()
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
    elif mesh.size() > 2:
        # Over more than two ranks the sums depend on the bucket layout, which DDP changes after
        # the first step: a resumed run's first step must be reduced as the same step was.
        apply_same_layout_reduction(model, mesh.get_group())
    logger.info(f"applied DDP over mesh {_mesh_text(mesh)} (bucket {bucket_cap_mb} MB, reduce {reduce_dtype})")


def apply_fsdp_replicate(model: nn.Module, mesh: DeviceMesh, reduce_dtype: torch.dtype,
                         blocks: Sequence[nn.Module] | None = None) -> None:
    """Replicated data parallelism for a model that other parallelisms already touched: PyTorch's
    FSDP-based `replicate`, per block (`blocks`, default `model.layers`' blocks) and at the root.
    Unlike the composable DDP it accepts TP's DTensor parameters, and a pipeline stage can defer
    its all-reduce to the last microbatch."""
    replicate_fsdp = torch_compat_composable.fsdp_based_replicate()
    if replicate_fsdp is None:
        raise ConfigError(f"DDP combined with tensor or pipeline parallelism needs PyTorch's FSDP-based replicate, "
                          f"which torch {torch.__version__} lacks; shard instead (training.data_parallel_shard_degree > 1)")
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=reduce_dtype)
    for block in (model.layers.values() if blocks is None else blocks):
        replicate_fsdp(block, mesh=mesh, mp_policy=policy)
    replicate_fsdp(model, mesh=mesh, mp_policy=policy)
    logger.info(f"applied DDP (FSDP-based replicate) over mesh {_mesh_text(mesh)} (reduce {reduce_dtype})")


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str,
    cpu_offload: bool = False,
    blocks: Sequence[nn.Module] | None = None,
) -> None:
    """FSDP2 `fully_shard` per transformer block (`blocks`, in forward order; default
    `model.layers`' blocks), then at the root (embedding, norm, output).
    A 2-D mesh gives HSDP: replicated over its first dim, sharded over its second."""
    config = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    if cpu_offload:
        # Pinned host memory makes the host-device copies asynchronous; it needs an accelerator.
        config["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    blocks = list(model.layers.values()) if blocks is None else list(blocks)
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
    prefetch_next_blocks(model, blocks, mesh.device_type)
    kind = "HSDP" if mesh.ndim > 1 else "FSDP"
    offload = "; parameters, gradients and optimizer state offloaded to CPU" if cpu_offload else ""
    logger.info(f"applied {kind} over mesh {_mesh_text(mesh)} (params {param_dtype}, "
                f"reduce {reduce_dtype}, reshard after forward: {reshard_after_forward}{offload}; "
                f"forward prefetch of the next block)")


def prefetch_next_blocks(model: nn.Module, blocks: list[nn.Module], device_type: str) -> None:
    """Each FSDP module issues the next block's all-gather right after its own, so that gather runs
    while the module computes.

    On CUDA this only issues earlier what FSDP2 already overlaps on its all-gather stream (its
    documentation: the same overlap and memory as the default, the all-gather issued sooner). On
    CPU there is no stream: FSDP2's default gathers each block synchronously when the block starts
    (all of it exposed), so its all-gathers are made asynchronous too; they then run on gloo's
    threads under compute, backward's default prefetch of the previous block included. The cost
    on CPU is one more block's gathered parameters alive during forward, as on CUDA already.
    """
    for current, following in zip([model, *blocks], blocks):
        current.set_modules_to_forward_prefetch([following])
    if device_type == "cpu":
        torch_compat_composable.set_unshard_async(model)
