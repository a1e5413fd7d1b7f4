"""Optimizers and learning-rate schedules, one of each per model part (pipeline stage)."""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from torchtitan.config.job_config import JobConfig
from torchtitan.optimizers.low_precision_adamw import LowPrecisionAdam
from torchtitan.optimizers.muon import MuonSplit
from torchtitan.optimizers.rounding import RoundingStream
from torchtitan.parallelisms.mixed_precision import resolve_param_dtype
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.zero1 import ReplicaOwnership
from torchtitan.runtime.torch_compat import optim as torch_compat_optim

logger = logging.getLogger(__name__)
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


def _param_groups(params: list[nn.Parameter]) -> list[dict[str, Any]]:
    """DTensor and plain parameters in separate groups (same hyperparameters): the foreach
    kernels of one group cannot mix the two, and a layout may leave some parameters plain (the
    norms under tensor parallelism without sequence parallelism). A ZeRO-1 replica may own none
    of a part's parameters: its optimizer then has one empty group (and no state)."""
    dtensors = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [{"params": group} for group in (dtensors, plain) if group] or [{"params": []}]


def _local_numel(p: torch.Tensor) -> int:
    return (p.to_local() if isinstance(p, DTensor) else p).numel()


class OptimizersContainer(Stateful):
    """Steps one optimizer per model part as if they were one; checkpointed by parameter name.
    With optimizer.name Muon, two per part: AdamW for the rest, Muon for the matrices (optimizers/muon.py).

    With `zero1`, each optimizer holds only the parameters this replica owns (parallelisms/zero1.py),
    and every step ends by sending the owners' updates to the other replicas.
    """

    def __init__(self, model_parts: list[nn.Module], optimizer_cls: type, kwargs: dict[str, Any],
                 zero1: ReplicaOwnership | None = None, muon: MuonSplit | None = None):
        self.model_parts = model_parts
        self.zero1 = zero1
        # Frozen parameters (LoRA's base) get no optimizer state, under ZeRO-1 no owner either.
        keep = zero1.owns if zero1 is not None else (lambda p: p.requires_grad)
        # Each part's optimizers, for the state dict: one here (two with Muon: AdamW for the rest, Muon for
        # the matrices), one per parameter when they step in backward.
        self._part_optimizers = []
        for part in model_parts:
            named = [(name, p) for name, p in part.named_parameters() if keep(p)]
            if muon is None:
                self._part_optimizers.append([optimizer_cls(_param_groups([p for _, p in named]), **kwargs)])
            else:
                rest = [p for name, p in named if not muon.takes(name, p)]
                self._part_optimizers.append([optimizer_cls(_param_groups(rest), **kwargs),
                                              muon.build([p for name, p in named if muon.takes(name, p)])])
        self.optimizers = [optimizer for optimizers in self._part_optimizers for optimizer in optimizers]

    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """One update of every part. `found_inf`: a 0-dim device tensor, 1.0 to skip the update
        (the fused kernels read it on the device, as for GradScaler, and roll their step count back)."""
        for optimizer in self.optimizers:
            optimizer.found_inf = found_inf  # torch's Adam/AdamW read it at every step; None: no skip
            optimizer.step()
        if self.zero1 is not None:
            self.zero1.broadcast_updates()

    def zero_grad(self) -> None:
        # Every parameter's gradient, including those whose update another ZeRO-1 replica owns.
        for part in self.model_parts:
            part.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        # Fully qualified parameter names make the state independent of the parallel layout.
        # Flattened ("state.<param>.<key>") so the parts' entries never collide when merged.
        merged: dict[str, Any] = {}
        for part, optimizers in zip(self.model_parts, self._part_optimizers):
            if _holding(optimizers):
                merged.update(get_optimizer_state_dict(part, _holding(optimizers), options=_FLAT))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The learning rate belongs to the LR schedulers (restored beside this, in either order):
        # a resumed run with another schedule (e.g. more steps) must apply the rate it logs, not
        # the one the checkpoint's param groups happened to hold.
        for part, optimizers in zip(self.model_parts, self._part_optimizers):
            optimizers = _holding(optimizers)
            if not optimizers:
                continue
            lrs = [[group["lr"] for group in optimizer.param_groups] for optimizer in optimizers]
            set_optimizer_state_dict(part, optimizers, optim_state_dict=state_dict, options=_FLAT)
            for optimizer, saved in zip(optimizers, lrs):
                for group, lr in zip(optimizer.param_groups, saved):
                    group["lr"] = lr


def _holding(optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """The optimizers that hold a parameter. Under ZeRO-1 a replica may own no matrix (its Muon is
    empty) or only matrices (its AdamW is): such an optimizer has no state to save or load, and
    torch's flattened optimizer state dicts cannot take one (they name each group by its first
    parameter)."""
    return [o for o in optimizers if any(group["params"] for group in o.param_groups)]


class OptimizersInBackwardContainer(OptimizersContainer):
    """optimizer.early_step_in_backward: one optimizer per parameter, stepped by that parameter's
    post-accumulate-grad hook as soon as backward has produced its final gradient, which is then
    freed, so the whole model's gradients never exist at once. FSDP2 calls these hooks on the
    sharded parameters after its reduce-scatter (and HSDP's all-reduce), so each step sees the
    reduced gradient shard. step() has nothing left to do.

    The updates equal the plain container's (same per-parameter math), and the state dict has the
    same keys, so a checkpoint moves between the two. Layouts that cannot compose (clipping,
    accumulation, pipelining, ZeRO-1, DDP) are refused by the config checks.
    """

    def __init__(self, model_parts: list[nn.Module], optimizer_cls: type, kwargs: dict[str, Any]):
        self.model_parts = model_parts
        self.zero1 = None
        # Norms of the gradients the hooks applied since zero_grad(), for grad_norm().
        self._norms: list[torch.Tensor] = []
        self._part_optimizers = []
        for part in model_parts:
            # Trainable parameters only, as in the plain container, so the state dicts match.
            trainable = [p for p in part.parameters() if p.requires_grad]
            optimizers = [optimizer_cls([p], **kwargs) for p in trainable]
            for p, optimizer in zip(trainable, optimizers):
                p.register_post_accumulate_grad_hook(functools.partial(self._step_parameter, optimizer))
            self._part_optimizers.append(optimizers)
        self.optimizers = [optimizer for optimizers in self._part_optimizers for optimizer in optimizers]

    def _step_parameter(self, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
        # The norm is a local reduction (a DTensor norm stays partial until grad_norm() combines it).
        self._norms.append(torch.linalg.vector_norm(param.grad.detach(), dtype=torch.float32))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """Nothing: every parameter stepped in backward (the trainer reads its agreement at once)."""

    def zero_grad(self) -> None:
        self._norms.clear()
        super().zero_grad()  # the hooks freed what they applied; this clears any gradient no hook saw

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients applied since zero_grad(): what clip_grad_norm_ measures in
        the usual path, where the gradients still exist after backward."""
        norms, by_layout = [], {}
        for norm in self._norms:
            if isinstance(norm, DTensor):
                by_layout.setdefault((norm.device_mesh, norm.placements), []).append(norm.to_local())
            else:
                norms.append(norm.reshape(1))
        # One collective per layout: the local norms of one (mesh, placements) stacked as one DTensor
        # whose placements say how to combine them across ranks into each parameter's global norm.
        for (mesh, placements), local in by_layout.items():
            norms.append(DTensor.from_local(torch.stack(local), mesh, placements, run_check=False).full_tensor())
        if not norms:
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.cat(norms))


def build_optimizers(model_parts: list[nn.Module], job_config: JobConfig,
                     parallel_dims: ParallelDims | None = None) -> OptimizersContainer:
    optimizer = job_config.optimizer
    kwargs = {
        "lr": optimizer.lr,
        "betas": (optimizer.beta1, optimizer.beta2),
        "eps": optimizer.eps,
        "weight_decay": optimizer.weight_decay,
        # PyTorch has fused kernels for CPU and CUDA; foreach (multi-tensor) is the fallback for others.
        "fused": optimizer.fused,
        "foreach": not optimizer.fused,
    }
    # Muon: AdamW for what is not a matrix (optimizers/muon.py).
    optimizer_cls = _OPTIMIZERS["AdamW" if optimizer.name == "Muon" else optimizer.name]
    rounding_stream = RoundingStream(max(job_config.training.seed, 0))  # bf16 state's stochastic rounding
    if optimizer.state_dtype == "bfloat16":  # moments in bf16, the update in fp32 (low_precision_adamw.py)
        optimizer_cls = functools.partial(LowPrecisionAdam, decoupled_weight_decay=optimizer.name in ("AdamW", "Muon"),
                                          stochastic_rounding=optimizer.state_rounding == "stochastic",
                                          rounding_stream=rounding_stream)
    if optimizer.early_step_in_backward:  # validated: no clipping, accumulation, PP, ZeRO-1 or DDP (config/rules.py)
        logger.info("applied optimizer steps in backward: each parameter is updated as soon as its gradient is "
                    "final, and the gradient freed")
        return OptimizersInBackwardContainer(model_parts, optimizer_cls, kwargs)
    muon = MuonSplit.from_config(job_config, rounding_stream) if optimizer.name == "Muon" else None
    zero1 = None
    if optimizer.zero1:  # validated to come with dp_replicate > 1 (config/rules.py)
        zero1 = ReplicaOwnership(model_parts, parallel_dims.replicate_mesh)
        owned = [p for p in zero1.params if zero1.owns(p)]
        logger.info(f"applied ZeRO-1 over mesh {{'dp_replicate': {zero1.size}}}: this replica keeps the optimizer state "
                    f"of {len(owned)} of {len(zero1.params)} parameter tensors "
                    f"({sum(_local_numel(p) for p in owned):,} of {sum(_local_numel(p) for p in zero1.params):,} elements)")
    if muon is not None:
        matrices = [name for part in model_parts for name, p in part.named_parameters()
                    if p.requires_grad and muon.takes(name, p)]
        device_type = next((p.device.type for part in model_parts for p in part.parameters()), "cpu")
        ns_dtype = str(resolve_param_dtype(muon.ns_dtype, device_type)).removeprefix("torch.")
        logger.info(f"applied Muon to {len(matrices)} matrix parameters (Newton-Schulz in {ns_dtype}, update "
                    f"scale {optimizer.muon_update_scale}), AdamW to the rest (excluded by name: "
                    f"{','.join(optimizer.muon_exclude) or 'none'})")
    return OptimizersContainer(model_parts, optimizer_cls, kwargs, zero1, muon)


def lr_factor(step: int, warmup_steps: int, total_steps: int, decay_type: str, lr_min: float) -> float:
    """Multiplier of the peak lr after `step` scheduler steps: linear warm-up, then decay to lr_min.

    Warm-up starts above zero ((step+1)/(warmup+1)) so the very first update is not wasted.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    if decay_type == "linear":
        remaining = 1.0 - progress
    elif decay_type == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay_type == "constant":
        remaining = 1.0
    else:
        raise ValueError(f"unknown decay_type {decay_type!r}")
    return lr_min + (1.0 - lr_min) * remaining


class LRSchedulersContainer(Stateful):
    """One LambdaLR per optimizer, stepped together; they always share one position."""

    def __init__(self, optimizers: OptimizersContainer, factor_fn):
        self.schedulers = [LambdaLR(opt, factor_fn) for opt in optimizers.optimizers]

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for scheduler in self.schedulers:
            scheduler.last_epoch = state_dict["last_epoch"]
            lrs = [base * scheduler.lr_lambdas[0](scheduler.last_epoch) for base in scheduler.base_lrs]
            torch_compat_optim.set_last_lr(scheduler, lrs)  # keep get_last_lr() true before the next step
            for group, lr in zip(scheduler.optimizer.param_groups, lrs):
                group["lr"] = lr


def build_lr_schedulers(optimizers: OptimizersContainer, job_config: JobConfig) -> LRSchedulersContainer:
    training = job_config.training
    factor = functools.partial(
        lr_factor, warmup_steps=training.warmup_steps, total_steps=training.steps, decay_type=training.decay_type, lr_min=training.lr_min
    )
    return LRSchedulersContainer(optimizers, factor)
