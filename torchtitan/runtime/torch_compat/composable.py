"""Composable data parallelism and activation-checkpoint wrappers that PyTorch keeps under private
modules, and the private state the setup record reads from them."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.distributed._composable.contract import _get_registry
from torch.distributed._composable.replicate import replicate as _replicate
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as _checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule

from torchtitan.runtime.torch_compat import CPU, CPU_AND_GPU_CHECK, CPU_AND_PRESENT_IN_2_11, PrivateName

PRIVATE_NAMES = (
    PrivateName("torch.distributed._composable.replicate.replicate", ("module", "ignored_modules")),
    PrivateName("torch.distributed._composable.replicate._ReplicateState._ddp", instance=True),
    PrivateName("torch.distributed.Reducer._rebuild_buckets", checked=CPU),
    PrivateName("torch.distributed.Reducer._get_zeros_like_grad_buckets", checked=CPU),
    PrivateName("torch.distributed._composable.replicate_with_fsdp.replicate", ("module", "mesh", "mp_policy"),
                checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName("torch.distributed._composable.contract._get_registry", ("module",), checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName("torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper",
                ("module", "checkpoint_impl", "checkpoint_fn")),
    PrivateName("torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointWrapper",
                ("mod", "checkpoint_impl", "checkpoint_fn")),
    PrivateName("torch.distributed.algorithms._checkpoint.checkpoint_wrapper.ActivationWrapper", ("mod",)),
    PrivateName("torch.distributed.algorithms._checkpoint.checkpoint_wrapper.ActivationWrapper._checkpoint_wrapped_module",
                instance=True),
    PrivateName("torch.distributed.algorithms._checkpoint.checkpoint_wrapper._CHECKPOINT_PREFIX"),
    PrivateName("torch.distributed.fsdp.FSDPModule._get_fsdp_state", ("self",)),
    # One of the two: a list of groups in 2.13, at most one group in 2.11 (missing there: the seam's
    # names were checked on the GPU machine's torch 2.11.0 by test_torch_compat, 2026-11-27).
    PrivateName("torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._fsdp_param_groups", instance=True,
                optional=True),
    PrivateName("torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._fsdp_param_group", instance=True,
                optional=True),
    PrivateName("torch.nn.Module._compiled_call_impl", instance=True, checked=CPU_AND_GPU_CHECK),
    PrivateName("torch.distributed.fsdp.FSDPModule._set_unshard_async_op", ("self", "async_op"), checked=CPU),
    PrivateName("torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._states_to_forward_prefetch",
                instance=True, checked=CPU),
    PrivateName("torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._modules", instance=True, checked=CPU),
)

# Composable DDP (`replicate(module, device_mesh=, bucket_cap_mb=)`): DDP's buckets and hooks on the
# module as it is, its class unchanged. Public DDP wraps the module, which would rename every
# parameter and checkpoint key; composable DDP is only under a private module in torch 2.11-2.13.
replicate = _replicate

# Wraps a module so its forward is recomputed in backward (`checkpoint_wrapper(module,
# preserve_rng_state=, context_fn=)`), keeping parameter names under `_checkpoint_wrapped_module`
# as every torchtitan checkpoint expects; torch.utils.checkpoint offers only the function.
checkpoint_wrapper = _checkpoint_wrapper.checkpoint_wrapper
CheckpointWrapper = _checkpoint_wrapper.CheckpointWrapper  # the wrapper's class, to recognise one
# The base class of both of torch's block wrappers: a subclass's `forward` runs the wrapped module
# (`_checkpoint_wrapped_module`) as it likes, and parameter names and state-dict keys stay those of
# the bare module (DCP strips the same prefix), so wrappers nest in any order.
ActivationWrapper = _checkpoint_wrapper.ActivationWrapper


def wrapped_module(wrapper: nn.Module) -> nn.Module:
    """The module an ActivationWrapper runs (kept under its private `_checkpoint_wrapped_module`)."""
    return wrapper._checkpoint_wrapped_module


def bare_name(name: str) -> str:
    """A parameter's name in the bare model. A parent's named_parameters() names the parameters of
    a wrapped block through the wrapper's private attribute (`layers.1._checkpoint_wrapped_module.
    attention.wq.weight`); state dicts strip it, and so must whatever matches names from the config."""
    return name.replace(_checkpoint_wrapper._CHECKPOINT_PREFIX, "")


def fsdp_based_replicate() -> Callable[..., Any] | None:
    """PyTorch's FSDP-based `replicate(module, mesh=, mp_policy=)` (accepts DTensor parameters,
    unlike composable DDP), or None where the installed torch lacks it. It exists only under a
    private module in torch 2.11-2.13."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate as replicate_fsdp
    except ImportError:
        return None
    return replicate_fsdp


def fsdp_param_groups(module: FSDPModule) -> list:
    """FSDP2's parameter groups of `module` (mesh info, resharding, policies per group): fully_shard
    keeps them in its private state only: a list in torch 2.13, one group (or None) in 2.11."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def replicated_by_ddp(module: nn.Module) -> bool:
    """Whether composable DDP (`replicate`) was applied to `module`: it leaves the class alone and
    records itself in the module's private registry of composable APIs."""
    return "replicate" in (_get_registry(module) or {}) and not isinstance(module, FSDPModule)


def ddp_of(module: nn.Module) -> Any:
    """The DistributedDataParallel object composable DDP built for `module` (at its first forward),
    or None before; it is kept in replicate's private state."""
    return getattr(_replicate.state(module), "_ddp", None)


def rebuild_ddp_buckets(ddp: Any) -> list[tuple[torch.Tensor, list[nn.Parameter]]]:
    """Has DDP rebuild its gradient buckets now, in the order the gradients of the backward that
    just ended arrived, as it does by itself before the next forward (a no-op once rebuilt); returns
    each bucket as a zero buffer and its parameters in their order in it. DDP's reducer offers
    both only as private methods."""
    ddp.reducer._rebuild_buckets()
    return [(bucket.buffer(), bucket.parameters()) for bucket in ddp.reducer._get_zeros_like_grad_buckets()]


def compiled_call(module: nn.Module) -> Any:
    """What `nn.Module.compile` installed as the module's call, or None where it was not compiled;
    the module keeps it in `_compiled_call_impl` with no public getter."""
    return getattr(module, "_compiled_call_impl", None)


def set_unshard_async(module: FSDPModule) -> None:
    """Makes FSDP2 issue every all-gather of `module` and the FSDP modules inside it with
    `async_op=True`. Its default (False) blocks the issuing thread where there are no streams (CPU),
    so a prefetched all-gather would finish before the block it was meant to hide under starts;
    only the private `_set_unshard_async_op` (torch 2.11-2.13) changes it."""
    module._set_unshard_async_op(True)


def forward_prefetch_targets(module: FSDPModule) -> list[nn.Module]:
    """The modules whose all-gathers `module` issues in forward (`set_modules_to_forward_prefetch`,
    which has no getter): kept in its private FSDP state."""
    return [m for state in module._get_fsdp_state()._states_to_forward_prefetch for m in state._modules]
