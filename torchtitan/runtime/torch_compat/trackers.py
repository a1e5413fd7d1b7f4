"""PyTorch's memory trackers (torch.distributed._tools: memory by category, on real or fake
tensors) extended to a pipeline rank's several model parts and optimizers."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModState
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule

from torchtitan.runtime.torch_compat import CPU_AND_GPU_CHECK, CPU_AND_PRESENT_IN_2_11, PrivateName

_TOOLS = "torch.distributed._tools"
PRIVATE_NAMES = (
    PrivateName(f"{_TOOLS}.mem_tracker.MemTracker", (), checked=CPU_AND_GPU_CHECK),
    PrivateName(f"{_TOOLS}.mem_tracker.MemTracker._pre_fw_hook", ("self", "module", "inputs"), checked=CPU_AND_GPU_CHECK),
    PrivateName(f"{_TOOLS}.mem_tracker.MemTracker._mod_tracker", instance=True, checked=CPU_AND_GPU_CHECK),
    PrivateName(f"{_TOOLS}.mem_tracker.MemTracker._track_optimizer_states", ("self", "reftype", "optimizer"),
                checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName(f"{_TOOLS}.mem_tracker.MemTracker._ref_class", instance=True),
    PrivateName(f"{_TOOLS}.mem_tracker.MemTracker._in_opt", instance=True),
    PrivateName(f"{_TOOLS}.mem_tracker.MemTracker._optimizer_hook_handles", instance=True),
    PrivateName(f"{_TOOLS}.fsdp2_mem_tracker.FSDPMemTracker", ("mod", "optm")),
    PrivateName(f"{_TOOLS}.fsdp2_mem_tracker.FSDPMemTracker._root_mod", instance=True),
    PrivateName(f"{_TOOLS}.fsdp2_mem_tracker.FSDPMemTracker._fsdp_state_pre_forward",
                ("self", "fsdp_mod", "orig_fsdp_state_pre_fw"),
                checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName(f"{_TOOLS}.fsdp2_mem_tracker.FSDPMemTracker._instrument_optimizer", ("self",), checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName(f"{_TOOLS}.fsdp2_mem_tracker._FSDPModState"),
    PrivateName(f"{_TOOLS}.fsdp2_mem_tracker._FSDPModMemStats.local_peak", instance=True),
    PrivateName(f"{_TOOLS}.mem_tracker.MemTracker._update_peak_stats", ("self", "peak_state")),
    PrivateName(f"{_TOOLS}.mem_tracker.MemTracker.memory_tracking", instance=True),
    PrivateName(f"{_TOOLS}.mem_tracker.MemTracker._track_module_params_and_buffers",
                ("self", "module", "install_grad_hooks")),
    PrivateName(f"{_TOOLS}.mem_tracker.MemTracker._param_to_grad_hook_handles", instance=True),
)

__all__ = ["FSDPMemTracker", "FSDPPartsTracker", "MemTracker", "PartsTracker"]
_TOTAL = "Total"  # the trackers' key of a snapshot's sum


class _TrackedModules:
    """What `_update_peak_stats` reads of `memory_tracking`: its values, from a plain list."""

    def __init__(self, stats: list[Any]):
        self.stats = stats

    def values(self) -> list[Any]:
        return self.stats


class _PeaksFromAList:
    """PyTorch's trackers update every tracked module's peak after every op by walking
    `memory_tracking`, a dictionary of weak references whose every read asks the module for
    `_fix_weakref`: an attribute lookup that fails, through each wrapper (activation
    checkpointing's), for every module and op, about half of a dry run's step for an 80-block
    model. The same walk over a plain list of the same statistics (renewed when a module is
    added) computes the same peaks."""

    _stats_list: list[Any] = []
    _stats_count = -1

    def _update_peak_stats(self, peak_state: Any) -> None:
        tracking = self.memory_tracking
        if len(tracking) != self._stats_count:
            self._stats_list, self._stats_count = list(tracking.values()), len(tracking)
        self.memory_tracking = _TrackedModules(self._stats_list)
        try:
            super()._update_peak_stats(peak_state)
        finally:
            self.memory_tracking = tracking


# PyTorch measures a step's memory by category only with these trackers, in a private package; the
# two subclasses below override and call their private hooks (listed above) to take several parts.
class FSDPPartsTracker(_PeaksFromAList, FSDPMemTracker):
    """FSDPMemTracker over several FSDP roots (the stages a pipeline rank holds) and several
    optimizers (one per part). PyTorch's tracker takes one root and one optimizer; it reads the
    root only through `.modules()` and `.buffers()`, which a ModuleList of the parts answers for
    all of them, and it hooks the optimizer only in `_instrument_optimizer`, done here for each.

    It also takes a root's forward run several times in one step (pipeline microbatches,
    gradient accumulation), which PyTorch's tracker refuses as "the next iteration": each further
    forward of a root is tracked as if inside a `Microbatch` parent module."""

    _MICROBATCH = "Microbatch"

    def __init__(self, parts: list[nn.Module], optimizers: list[Any]):
        super().__init__(parts[0], None)
        self._root_mod = nn.ModuleList(parts)
        self._roots = set(map(id, parts))
        self._all_optimizers = optimizers

    def _fsdp_state_pre_forward(self, fsdp_mod: FSDPModule, orig: Any) -> Any:
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

        def again(*args: Any, **kwargs: Any) -> Any:
            stats = self.memory_tracking.get(fsdp_mod)
            if stats is not None and not self._mod_tracker.is_bw:
                self._new_forward_peak(stats)
            repeated = (id(fsdp_mod) in self._roots and fsdp_mod in self.memory_tracking
                        and not self._mod_tracker.is_bw)
            if repeated:
                self._mod_tracker.parents.add(self._MICROBATCH)
            try:
                return inner(*args, **kwargs)
            finally:
                if repeated:
                    self._mod_tracker.parents.discard(self._MICROBATCH)

        return again

    def _new_forward_peak(self, stats: Any) -> None:
        """A further forward of a tracked FSDP module (a microbatch's, an accumulation step's) starts
        its own forward peak and the snapshot before it, as its first forward does (PyTorch's tracker
        keeps one forward peak per FSDP module, from the first call on): each forward's peak then
        pairs with the memory it started from, as MemTracker's do."""
        snapshot = self.get_tracker_snapshot()
        stats.local_peak = {device: per_device[_TOTAL] for device, per_device in snapshot.items()}
        stats.snapshots.setdefault(_FSDPModState.PEAK_FW, []).append(snapshot)
        stats.snapshots.setdefault(_FSDPModState.BEF_PRE_FW, []).append(copy.deepcopy(snapshot))

    def _instrument_optimizer(self) -> None:
        handles = []
        for optimizer in self._all_optimizers:
            self._track_optimizer_states(self._ref_class.OPT, optimizer)

            def pre(opt, args, kwargs) -> None:
                self._in_opt = True

            def post(opt, args, kwargs) -> None:
                self._track_optimizer_states(self._ref_class.OPT, opt)
                self._in_opt = False

            handles += [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
        self._optimizer_hook_handles = tuple(handles)


class _NoHook:
    """Stands for the gradient hooks a frozen parameter cannot take."""

    @staticmethod
    def remove() -> None:
        pass


class PartsTracker(_PeaksFromAList, MemTracker):
    """MemTracker that, like FSDPPartsTracker, takes a model part's forward run several times in
    one step (pipeline microbatches, gradient accumulation), and frozen parameters (LoRA's base)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self._roots = set(map(id, parts))

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        # MemTracker hooks every parameter's gradient, and registering a hook on a parameter that
        # needs no gradient raises; such a parameter has no gradient to count: it is marked hooked.
        for p in module.parameters():
            if not p.requires_grad and p not in self._param_to_grad_hook_handles:
                self._param_to_grad_hook_handles[p] = (_NoHook, _NoHook)
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        repeated = id(module) in self._roots and module in self.memory_tracking and not self._mod_tracker.is_bw
        if repeated:
            self._mod_tracker.parents.add(FSDPPartsTracker._MICROBATCH)
        try:
            super()._pre_fw_hook(module, inputs)
        finally:
            if repeated:
                self._mod_tracker.parents.discard(FSDPPartsTracker._MICROBATCH)
