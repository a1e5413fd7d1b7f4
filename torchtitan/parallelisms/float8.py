"""Float8 training of linear layers through torchao (optional dependency, CUDA with float8 units).

The model's nn.Linear layers (except the output projection, whose accuracy matters most) are
swapped for torchao's Float8Linear before any other parallelism. Tensor parallelism then uses
torchao's float8 plan styles for them (`float8_tp_styles`), which cast to float8 before the TP
collectives, so all-gathers move float8 bytes and scales come from the amax over the whole
(sharded) tensor. FSDP shards the float8 modules and, when asked, all-gathers their weights in
float8 too. `float8.emulate` runs the same code where there are no float8 units (CPU tests).

`float8.recipe` picks the scaling: tensorwise (one scale a tensor, the above), or torchao's rowwise
recipes (one scale a row of each operand, power-of-two scales; rowwise_with_gw_hp keeps the weight
gradient's matmul in high precision). torchao's float8 TP styles and float8 all-gather scale whole
tensors, so under a rowwise recipe TP uses the plain styles (high-precision activations through
the collectives, cast inside each linear) and FSDP all-gathers high-precision weights.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.errors import ConfigError
from torchtitan.runtime.torch_compat.compile import emulate_precision_casts

logger = logging.getLogger(__name__)


def check_float8_support(job_config: JobConfig, device_type: str, tp_enabled: bool) -> None:
    """Refuses float8 where it cannot run, before any process group exists."""
    float8 = job_config.float8
    if not float8.enable_float8_linear:
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("float8.enable_float8_linear needs torchao: .venv/bin/pip install -e '.[float8]'")
    if device_type == "cpu" and uses_float8_tp_styles(job_config) and tp_enabled \
            and not job_config.training.disable_sequence_parallel:
        # torchao's sequence-parallel styles move float8 activations (forward) and float8 gradients
        # (backward) through the TP collectives.
        raise ConfigError("float8 with tensor and sequence parallelism sends float8 tensors through the TP collectives, "
                          "which gloo (CPU) cannot carry; on CPU add --training.disable_sequence_parallel (float8 TP "
                          "without it runs here); on CUDA GPUs NCCL carries them and the layout runs as configured")
    if float8.emulate:  # runs anywhere; apply_float8 says it is emulated
        return
    if device_type != "cuda":
        raise ConfigError("float8.enable_float8_linear needs CUDA GPUs with float8 units (H100 or newer); "
                          "this machine has none (float8.emulate runs it emulated, for tests)")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise ConfigError(f"float8.enable_float8_linear needs a GPU of compute capability 8.9 or newer; "
                          f"{torch.cuda.get_device_name()} has {major}.{minor}")


def apply_float8(model: nn.Module, job_config: JobConfig) -> None:
    float8 = job_config.float8
    config = float8_linear_config(float8.recipe, float8.enable_fsdp_float8_all_gather, float8.emulate)
    from torchao.float8 import convert_to_float8_training

    if float8.recipe != "tensorwise" and job_config.training.compile:
        # Rowwise scales under compile with activation checkpointing gave NaN losses unless inductor
        # rounds its casts as eager does (pytorch/pytorch#150859; torchtitan sets the same).
        emulate_precision_casts()

    # Float8 matmuls need dimensions divisible by 16; the output projection and MoE routers (whose
    # small score differences choose the experts) stay in high precision.
    convert_to_float8_training(
        model, config=config,
        module_filter_fn=lambda module, fqn: (fqn != "output" and "router" not in fqn.split(".")
                                              and module.in_features % 16 == 0 and module.out_features % 16 == 0),
    )
    logger.info(f"converted linear layers to float8, {float8.recipe} scaling (FSDP float8 all-gather "
                f"{'on' if float8.enable_fsdp_float8_all_gather else 'off'}"
                f"{'; matmuls emulated in high precision, for tests only' if float8.emulate else ''})")


def float8_linear_config(recipe: str, fsdp_float8_all_gather: bool = False, emulate: bool = False):
    """torchao's Float8LinearConfig of a float8.recipe: tensorwise is torchao's default config,
    the rowwise ones its named recipes."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    if recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather, emulate=emulate)
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)


# The model families whose TP plan uses torchao's float8 styles for float8 projections (Llama's
# parallelize passes float8 to its plan; Qwen3's keeps the plain styles for every recipe).
FLOAT8_TP_STYLE_MODELS = ("llama2", "llama3")


def uses_float8_tp_styles(job_config: JobConfig) -> bool:
    """Whether TP uses torchao's float8 styles: float8 on with tensorwise scaling, the only scaling
    those styles cast with (a rowwise recipe keeps the plain styles), in a family whose plan has them."""
    float8 = job_config.float8
    return (float8.enable_float8_linear and float8.recipe == "tensorwise"
            and job_config.model.name in FLOAT8_TP_STYLE_MODELS)


def is_float8(module: nn.Module) -> bool:
    """Whether apply_float8 converted this module (torchao is imported only when float8 is on)."""
    return type(module).__name__ == "Float8Linear"


def float8_tp_styles() -> tuple[type, type, type]:
    """torchao's float8 versions of ColwiseParallel, RowwiseParallel and PrepareModuleInput."""
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def precompute_float8_scales(model_parts: list[nn.Module]) -> None:
    """One all-reduce for every weight's float8 scale after the optimizer step, instead of one per
    weight at the next all-gather (used with FSDP float8 all-gather)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in model_parts:
        precompute_float8_dynamic_scale_for_fsdp(part)
