"""The least memory one training step can need, checked against what a rank has before start-up.

A batch or sequence length that cannot fit fails at once with one line naming both options,
instead of an allocation traceback minutes later (or an epoch loop that never fills a batch).
The floor counts only what no configuration avoids: this rank's share of the fp32 weights and
Adam state (and gradients, unless the optimizer steps in backward), the fp32 logits the loss reads,
and one saved input per transformer layer (what full activation checkpointing keeps), for one
micro-batch on this rank's share of the sequence, vocabulary and layers. Real steps need several
times more, so the check never refuses a job that would fit; memory planning proper is a
separate tool.
"""

from __future__ import annotations

import os
from typing import Any

from torchtitan.config.job_config import JobConfig
from torchtitan.errors import ConfigError
from torchtitan.parallelisms.parallel_dims import ParallelDims


def state_floor_bytes(job_config: JobConfig, parallel_dims: ParallelDims, n_params: int) -> int:
    """This rank's least share of the fp32 weights, gradients and Adam moments (4 + 4 + 8 bytes per
    parameter; 4 under LoRA, whose base is frozen): sharded by FSDP (over dp_shard x cp), TP and PP;
    the moments also by ZeRO-1's replicas."""
    if job_config.training.enable_cpu_offload and tt_device_is_cuda():
        return 0  # FSDP keeps them in host memory, which this check does not weigh
    split = parallel_dims.dp_shard * parallel_dims.cp * parallel_dims.tp * parallel_dims.pp
    if job_config.lora.rank > 0:  # a frozen base: no gradients, no moments (its adapters' are left out, as a floor may)
        return n_params * 4 // split
    grads = 0 if job_config.optimizer.early_step_in_backward else 4
    moments = 8 // (parallel_dims.dp_replicate if job_config.optimizer.zero1 else 1)
    return n_params * (4 + grads + moments) // split


def tt_device_is_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def step_floor_bytes(job_config: JobConfig, parallel_dims: ParallelDims, model_args: Any) -> int:
    training = job_config.training
    tokens = training.batch_size * training.seq_len // parallel_dims.cp
    if parallel_dims.pp > 1:
        microbatches = job_config.experimental.pipeline_parallel_microbatches
        tokens //= microbatches if microbatches > 0 else parallel_dims.pp
    vocab = getattr(model_args, "vocab_size", 0) + getattr(model_args, "vocab_padding", 0)
    if parallel_dims.loss_parallel_enabled:
        vocab //= parallel_dims.tp
    dim, layers = getattr(model_args, "dim", 0), getattr(model_args, "n_layers", 0)
    layers = -(-layers // parallel_dims.pp)
    act_bytes = 4 if training.mixed_precision_param == "float32" else 2  # "auto" may mean bf16: count the lesser
    sequence_parallel = parallel_dims.tp > 1 and not training.disable_sequence_parallel
    per_layer = tokens * dim * act_bytes // (parallel_dims.tp if sequence_parallel else 1)
    return tokens * vocab * 4 + layers * per_layer


def rank_memory_bytes(device_type: str) -> int | None:
    """Memory one rank can use: its GPU's, or the host's available memory shared by the ranks
    started on this host. None where it cannot be read."""
    if device_type == "cuda":
        import torch

        return torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory
    available = _host_available_bytes()
    if available is None:
        return None
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))))


def _host_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def check_step_fits(job_config: JobConfig, parallel_dims: ParallelDims, model_args: Any, device_type: str,
                    n_params: int = 0) -> None:
    """Refuses a model, or a batch x sequence, that cannot fit in this rank's memory, naming the
    options to change."""
    state = state_floor_bytes(job_config, parallel_dims, n_params)
    floor = step_floor_bytes(job_config, parallel_dims, model_args)
    memory = rank_memory_bytes(device_type)
    if memory is None or state + floor <= memory:
        return
    training, model = job_config.training, job_config.model
    where = "GPU" if device_type == "cuda" else "host memory available per rank"
    if state > memory:  # the model alone is the problem, whatever the batch
        raise ConfigError(
            f"model {model.name} {model.flavor} ({n_params / 1e9:.1f} billion parameters) needs at least {_size(state)} per rank "
            f"for its weights, gradients and optimizer state, more than this {where} ({_size(memory)}); use a smaller "
            "model.flavor, or shard it over more ranks (data_parallel_shard_degree, tensor or pipeline parallel)")
    raise ConfigError(
        f"training.batch_size {training.batch_size} x training.seq_len {training.seq_len} needs at least {_size(floor)} per rank "
        f"for one step's activations (the logits and each layer's input), which with the model's {_size(state)} is more "
        f"than this {where} ({_size(memory)}); "
        "lower training.batch_size or training.seq_len, or spread the work over more ranks (context, tensor or "
        "pipeline parallel)")
