"""TrainSpec: the one contract between the trainer and a model family.

`train.py` looks the spec up by `model.name` and uses nothing else model-specific, so adding a
model is one new folder plus one `register_train_spec` call (docs/extension.md). Every builder
has a typed signature below (a Protocol), so a type checker flags a model whose function drifts
from the contract, and `register_train_spec` refuses one whose parameters do not match, with one
line naming the builder and the parameter.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, NamedTuple, Protocol

from torchtitan.errors import ConfigError, UserError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from torchtitan.config.job_config import JobConfig
    from torchtitan.datasets.shards import DataShards
    from torchtitan.datasets.tokenizer import Tokenizer
    from torchtitan.models.hf_adapter import HFAdapter
    from torchtitan.parallelisms.parallel_dims import ParallelDims
    from torchtitan.parallelisms.pipeline import PipelinePlan
    from torchtitan.parallelisms.pipeline_runtime import Pipeline
    from torchtitan.trainer.optimizer import LRSchedulersContainer, OptimizersContainer


class TrainableModel(Protocol):
    """What the trainer calls on a model besides forward (`(batch, seq)` ids -> logits)."""

    @classmethod
    def from_model_args(cls, args: Any) -> nn.Module: ...  # called under torch.device("meta")

    def init_weights(self, buffer_device: torch.device | None = None) -> None: ...

    def flops_per_token(self, seq_len: int) -> int: ...


class ParallelizeFn(Protocol):
    """Applies the configured parallelisms (TP, CP, AC, compile, FSDP/HSDP/DDP) to a meta-device
    model or pipeline stage, taking meshes from `parallel_dims` by role, and returns it."""

    def __call__(self, model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module: ...


class LossFn(Protocol):
    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor: ...


class PipeliningFn(Protocol):
    """Cuts this rank's stages out of the meta-device model as `plan` places them, parallelizes
    each with `parallelize_fn` (the spec's own), and builds the schedule around `loss_fn`."""

    def __call__(self, model: nn.Module, *, model_args: Any, plan: PipelinePlan, parallel_dims: ParallelDims,
                 job_config: JobConfig, device: torch.device, parallelize_fn: ParallelizeFn,
                 loss_fn: LossFn) -> Pipeline: ...


class ValidateFn(Protocol):
    """Checks, before any process group exists, that the model's shapes allow the layout (head
    counts divisible by TP, enough blocks for the pipeline's stages, ...); raises ConfigError.
    `plan` is the job's pipeline plan, None without pipeline parallelism."""

    def __call__(self, model_args: Any, parallel_dims: ParallelDims, plan: PipelinePlan | None,
                 job_config: JobConfig) -> None: ...


class BuildOptimizersFn(Protocol):
    def __call__(self, model_parts: list[nn.Module], job_config: JobConfig,
                 parallel_dims: ParallelDims) -> OptimizersContainer: ...


class BuildLRSchedulersFn(Protocol):
    def __call__(self, optimizers: OptimizersContainer, job_config: JobConfig) -> LRSchedulersContainer: ...


class BuildTokenizerFn(Protocol):
    def __call__(self, job_config: JobConfig) -> Tokenizer: ...


class BuildDataloaderFn(Protocol):
    """A stateful iterable of `(inputs, labels)` batches for this rank's data shards (`shards`
    says which shards of how many; the count is decided once, from the config and a resumed
    checkpoint's data position)."""

    def __call__(self, job_config: JobConfig, tokenizer: Tokenizer, shards: DataShards) -> Iterable: ...


class StepReport(NamedTuple):
    """What an AfterStepFn has to log: `values` go to metrics.jsonl and TensorBoard under their
    names, `summary` (short) is appended to the console's step line."""

    values: dict[str, float]
    summary: str


class AfterStepFn(Protocol):
    """Runs on every rank after each optimizer step (it may use collectives: every rank calls
    it), for model state kept outside the optimizer, e.g. MoE routing biases and statistics.
    Returns a StepReport when `log` (a logging step), else None."""

    def __call__(self, model_parts: list[nn.Module], parallel_dims: ParallelDims, *, log: bool) -> StepReport | None: ...


@dataclass(frozen=True)
class TrainSpec:
    name: str
    model_cls: type[TrainableModel]
    config: Mapping[str, Any]  # flavor name -> model args (a dataclass with a vocab_size field)
    parallelize_fn: ParallelizeFn
    pipelining_fn: PipeliningFn | None  # None: pipeline_parallel_degree > 1 is refused with one line
    build_optimizers_fn: BuildOptimizersFn
    build_lr_schedulers_fn: BuildLRSchedulersFn
    build_tokenizer_fn: BuildTokenizerFn
    build_dataloader_fn: BuildDataloaderFn
    loss_fn: LossFn
    validate_fn: ValidateFn | None = None
    # Hugging Face names and layouts of this family's weights (scripts/convert_checkpoint.py);
    # None: the family has no Hugging Face conversion.
    hf_adapter: HFAdapter | None = None
    # Per-step work after the optimizer step (MoE load balancing and statistics); None: nothing.
    after_step_fn: AfterStepFn | None = None
    # The validation data (validation.*): finite batches, read from the start on each call; None:
    # validation.enabled is refused for this model.
    build_validation_dataloader_fn: BuildDataloaderFn | None = None


# Builders whose signature register_train_spec checks against the Protocol above.
_BUILDERS: dict[str, type] = {
    "parallelize_fn": ParallelizeFn,
    "pipelining_fn": PipeliningFn,
    "build_optimizers_fn": BuildOptimizersFn,
    "build_lr_schedulers_fn": BuildLRSchedulersFn,
    "build_tokenizer_fn": BuildTokenizerFn,
    "build_dataloader_fn": BuildDataloaderFn,
    "loss_fn": LossFn,
    "validate_fn": ValidateFn,
    "after_step_fn": AfterStepFn,
    "build_validation_dataloader_fn": BuildDataloaderFn,
}


def signature_mismatch(fn: Any, protocol: type) -> str | None:
    """Why `fn` cannot be called the way `protocol.__call__` is called (None when it can): the
    trainer passes the Protocol's positional parameters by position and its keyword-only ones by
    name, so those names must exist; extra parameters need defaults."""
    if not callable(fn):
        return "is not callable"
    try:
        sig = inspect.signature(fn)
    except ValueError:  # a builtin without a signature: trust it
        return None
    wanted = list(inspect.signature(protocol.__call__).parameters.values())[1:]  # without self
    params = list(sig.parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params) and any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    n_positional = sum(1 for p in wanted if p.kind is p.POSITIONAL_OR_KEYWORD)
    if len(positional) < n_positional and not any(p.kind is p.VAR_POSITIONAL for p in params):
        names = [p.name for p in wanted if p.kind is p.POSITIONAL_OR_KEYWORD]
        return f"takes {len(positional)} positional parameters, the trainer passes {n_positional} ({', '.join(names)})"
    by_name = {p.name: p for p in params}
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    for p in wanted:
        if p.kind is p.KEYWORD_ONLY and p.name not in by_name and not takes_kwargs:
            return f"has no parameter {p.name!r} (the trainer passes it by name)"
    for p in positional[n_positional:]:
        if p.default is p.empty:
            return f"needs parameter {p.name!r}, which the trainer does not pass"
    for p in params:
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty and p.name not in {w.name for w in wanted}:
            return f"needs keyword parameter {p.name!r}, which the trainer does not pass"
    return None


class SpecError(UserError, TypeError):
    """A TrainSpec whose builder does not take what the trainer passes: one line at registration
    (under `experimental.custom_import`, the run ends there with exit code 2)."""


_REGISTRY: dict[str, TrainSpec] = {}


def register_train_spec(spec: TrainSpec) -> None:
    """Makes `spec` available under `model.name = spec.name`, after checking that its builders
    take what the trainer passes them."""
    if spec.name in _REGISTRY:
        raise ValueError(f"a model named {spec.name!r} is already registered")
    for field_name, protocol in _BUILDERS.items():
        fn = getattr(spec, field_name)
        if fn is None:
            continue
        problem = signature_mismatch(fn, protocol)
        if problem is not None:
            where = f"{getattr(fn, '__module__', '?')}.{fn.__qualname__}" if hasattr(fn, "__qualname__") else repr(fn)
            raise SpecError(f"TrainSpec {spec.name!r}: {field_name} {where} {problem}; see {protocol.__name__} in "
                            "torchtitan/models/train_spec.py (docs/extension.md)")
    _REGISTRY[spec.name] = spec


def get_train_spec(name: str) -> TrainSpec:
    if name not in _REGISTRY:
        raise ConfigError(f"unknown model.name {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def registered_names() -> list[str]:
    return sorted(_REGISTRY)
