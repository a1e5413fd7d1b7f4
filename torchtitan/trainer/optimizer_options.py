"""Which optimizer options compose with the rest of the job; optimizer.py implements them.

Torch-free, so the launcher's pre-check refuses a bad combination before torch starts. The
rules registry (`config/rules.py`) names `check_muon`, `check_state` and `check_layout` here as its muon,
optimizer_state and optimizer_layout rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan.config.job_config import JobConfig
from torchtitan.errors import ConfigError

if TYPE_CHECKING:
    from torchtitan.parallelisms.parallel_dims import ParallelDims


def check_muon(config: JobConfig) -> None:
    """The Muon options' values (they are read only when optimizer.name is Muon)."""
    optimizer = config.optimizer
    if optimizer.name != "Muon":
        return
    if not 0 <= optimizer.muon_momentum < 1:
        raise ConfigError(f"optimizer.muon_momentum must lie in [0, 1), got {optimizer.muon_momentum}")
    if not 1 <= optimizer.muon_ns_steps <= 100:
        raise ConfigError(f"optimizer.muon_ns_steps must lie in [1, 100] (5 is the published choice), got "
                          f"{optimizer.muon_ns_steps}")
    if config.training.enable_cpu_offload:
        # FSDP's offloaded parameters are host tensors, and Muon gathers each matrix's update over
        # the device mesh (NCCL on GPUs), which cannot carry them.
        raise ConfigError("optimizer.name Muon does not compose with training.enable_cpu_offload (Muon gathers "
                          "whole matrices over the device mesh; offloaded shards live in host memory); use AdamW "
                          "with offload, or Muon without it")


def check_state(config: JobConfig) -> None:
    """optimizer.state_rounding says how bfloat16 moments are stored; fp32 moments are not rounded."""
    optimizer = config.optimizer
    if optimizer.state_rounding != "nearest" and optimizer.state_dtype != "bfloat16":
        raise ConfigError(f"optimizer.state_rounding {optimizer.state_rounding!r} rounds bfloat16 moments; set "
                          f"optimizer.state_dtype bfloat16 (got {optimizer.state_dtype!r}) or leave it 'nearest'")


def check_layout(config: JobConfig, dims: ParallelDims) -> None:
    if config.optimizer.zero1 and not dims.dp_replicate_enabled:
        raise ConfigError("optimizer.zero1 shards the optimizer state over data-parallel replicas, and this layout has "
                          "none (training.data_parallel_replicate_degree is 1); raise it, or rely on FSDP, which already "
                          "shards the optimizer state over data_parallel_shard_degree")
    if config.optimizer.early_step_in_backward:
        _check_early_step(config, dims)


def _check_early_step(config: JobConfig, dims: ParallelDims) -> None:
    """optimizer.early_step_in_backward steps each parameter as soon as its gradient is final and
    frees it. Whatever needs all gradients at once, or a parameter's gradient more than once per
    step, cannot compose with it. The features that never can are named first, then the settings
    to change: asking for training.max_norm 0 first would only lead to the real refusal. (Replica
    groups are refused by the fault_tolerance rule, which runs before this one.)"""
    name = "optimizer.early_step_in_backward"
    if dims.pp_enabled:
        raise ConfigError(f"{name} does not compose with pipeline parallelism (each microbatch's backward adds to the "
                          "gradients); set experimental.pipeline_parallel_degree 1")
    if config.optimizer.zero1:
        raise ConfigError(f"{name} does not compose with optimizer.zero1 (its owners broadcast updates after the "
                          "whole step); use one or the other")
    if config.optimizer.name == "Muon":
        raise ConfigError(f"{name} does not compose with optimizer.name Muon (Muon orthogonalises each whole matrix "
                          "after gathering its shards, a collective a per-parameter hook in backward cannot order); "
                          "use one or the other")
    if dims.ddp_enabled and not dims.tp_enabled:
        # Composable DDP all-reduces gradient buckets after the per-parameter hooks have run, so
        # each optimizer would see its rank's own gradient. FSDP (and the FSDP-based replicate
        # used with TP) calls the hooks after the reduction.
        raise ConfigError(f"{name} does not compose with DDP (data_parallel_replicate_degree {dims.dp_replicate} with "
                          "shard degree 1): DDP reduces gradients after the hooks step on them; shard instead "
                          "(data_parallel_shard_degree > 1, HSDP with replicas)")
    training = config.training
    if training.max_norm > 0:
        raise ConfigError(f"{name} applies and frees each gradient during backward, so no global norm can clip "
                          f"them; set training.max_norm 0 (got {training.max_norm})")
    if training.gradient_accumulation_steps > 1:
        raise ConfigError(f"{name} would step after the first micro-batch's gradient; set "
                          "training.gradient_accumulation_steps 1")
