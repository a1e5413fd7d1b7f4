"""Float8 training of linear layers through torchao (optional dependency, CUDA with float8 units).

The model's nn.Linear layers (except the output projection, whose accuracy matters most) are
swapped for torchao's Float8Linear before any other parallelism, so FSDP shards the float8
modules and, when asked, all-gathers their weights in float8.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from torchtitan.config_manager import ConfigError, JobConfig

logger = logging.getLogger(__name__)


def check_float8_support(job_config: JobConfig, device_type: str, tp_enabled: bool) -> None:
    """Refuses float8 where it cannot run, before any process group exists."""
    if not job_config.float8.enable_float8_linear:
        return
    if device_type != "cuda":
        raise ConfigError("float8.enable_float8_linear needs CUDA GPUs with float8 units (H100 or newer); "
                          "this machine has none")
    if torch.cuda.get_device_capability() < (8, 9):
        raise ConfigError(f"float8.enable_float8_linear needs a GPU of compute capability 8.9 or newer; "
                          f"{torch.cuda.get_device_name()} has {torch.cuda.get_device_capability()}")
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("float8.enable_float8_linear needs torchao: .venv/bin/pip install -e '.[float8]'")
    if tp_enabled:
        raise ConfigError("float8.enable_float8_linear with training.tensor_parallel_degree > 1 is not supported yet")


def apply_float8(model: nn.Module, job_config: JobConfig) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    f = job_config.float8
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=f.enable_fsdp_float8_all_gather)
    # Float8 matmuls need dimensions divisible by 16; the output projection stays in high precision.
    convert_to_float8_training(
        model, config=config,
        module_filter_fn=lambda module, fqn: fqn != "output" and module.in_features % 16 == 0 and module.out_features % 16 == 0,
    )
    logger.info(f"converted linear layers to float8 (FSDP float8 all-gather {'on' if f.enable_fsdp_float8_all_gather else 'off'})")


def precompute_float8_scales(model_parts: list[nn.Module]) -> None:
    """One all-reduce for every weight's float8 scale after the optimizer step, instead of one per
    weight at the next all-gather (used with FSDP float8 all-gather)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in model_parts:
        precompute_float8_dynamic_scale_for_fsdp(part)
