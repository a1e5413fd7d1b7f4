"""TrainSpec: everything the trainer needs to know about one model family, in one registration.

`train.py` looks the spec up by `model.name` and uses nothing else model-specific, so adding a
model is one new folder plus one `register_train_spec` call (see docs/extension.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from torchtitan.config_manager import ConfigError

# Builder signatures (kept as plain callables so a model can reuse or replace any of them):
#   parallelize_fn(model, parallel_dims, job_config) -> model  (meshes by role: parallel_dims.fsdp_mesh, .tp_mesh, ...)
#   pipelining_fn(model, parallel_dims, job_config, device, model_args, loss_fn)
#       -> (schedule, model_parts); None while the family has no pipeline support
#   build_optimizers_fn(model_parts, job_config, parallel_dims) -> OptimizersContainer
#   build_lr_schedulers_fn(optimizers, job_config) -> LRSchedulersContainer
#   build_tokenizer_fn(job_config) -> Tokenizer
#   build_dataloader_fn(job_config, tokenizer, dp_rank, dp_degree) -> Stateful iterable of (inputs, labels)
#   loss_fn(logits, labels) -> scalar loss
#   validate_fn(model_args, parallel_dims, job_config) -> None, raising ConfigError for a layout the
#       model's shapes cannot take (optional; runs before any process group exists)


@dataclass
class TrainSpec:
    name: str
    model_cls: type[nn.Module]
    config: dict[str, Any]  # flavor name -> model args (a dataclass the model class accepts)
    parallelize_fn: Callable[..., nn.Module]
    pipelining_fn: Callable[..., Any] | None
    build_optimizers_fn: Callable[..., Any]
    build_lr_schedulers_fn: Callable[..., Any]
    build_tokenizer_fn: Callable[..., Any]
    build_dataloader_fn: Callable[..., Any]
    loss_fn: Callable[..., Any]
    validate_fn: Callable[..., None] | None = None


_REGISTRY: dict[str, TrainSpec] = {}


def register_train_spec(spec: TrainSpec) -> None:
    """Makes `spec` available under `model.name = spec.name`."""
    if spec.name in _REGISTRY:
        raise ValueError(f"a model named {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec


def get_train_spec(name: str) -> TrainSpec:
    if name not in _REGISTRY:
        raise ConfigError(f"unknown model.name {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def registered_names() -> list[str]:
    return sorted(_REGISTRY)
