"""Per-rank memory of a training step by category, measured by PyTorch's own trackers.

`torch.distributed._tools` records every tensor a step allocates and files it under what it is:
FSDPMemTracker for models FSDP shards (sharded and unsharded parameters and gradients, all-gather
and reduce-scatter buffers, activations, temporaries, optimizer state), MemTracker for the rest.
Both work on real tensors and on fake ones (no memory, shapes only), which is how the dry run
estimates a rank of a cluster on a laptop; the same code measures a real step, so an estimate and a
measurement differ only where fake and real execution differ.

This module folds their categories into five that a user plans with:

    parameters      weights and buffers, sharded and gathered
    gradients       sharded and unsharded gradients
    optimizer       optimizer state (Adam's two moments)
    activations     what the forward keeps for the backward, and the step's inputs
    temporaries     short-lived tensors: gradients of activations, communication buffers

and reports them at the moment of the step's peak, plus each category's own maximum.

For mixture-of-experts models it also reports the experts' share (`StepMemory.experts`): the
bytes of the routed experts' parameter shards and of their optimizer state on this rank (a part of
the categories above), and the dispatch buffers: the most one MoE layer's forward adds to the
activations and temporaries above what it started from (tokens copied for their experts, the
all-to-all's send and receive buffers, the experts' intermediates), from the tracker's own
snapshots before and at the peak of each module's forward. The backward's gradients of these
buffers are of the same shapes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtitan.runtime.torch_compat.trackers import FSDPMemTracker, FSDPPartsTracker, MemTracker, PartsTracker

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")
EXPERT_PARTS = ("expert parameters", "expert optimizer", "dispatch buffers")
# PyTorch's reference types (their values, shared by both trackers) -> our categories.
_CATEGORY_OF = {
    "Parameter": "parameters", "Sharded Param": "parameters", "Unsharded Param": "parameters", "Buffer": "parameters",
    "Gradient": "gradients", "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations", "Inputs": "activations",
    "Temp": "temporaries", "All Gather": "temporaries", "Reduce Scatter": "temporaries", "Other": "temporaries",
}
# With FSDP's CPU offload these live in host memory, not on the device (FSDP keeps the sharded
# parameters, their gradients and so the optimizer state on the CPU).
_OFFLOADED = ("Sharded Param", "Sharded Grad", "OptState")
_TOTAL = "Total"


@dataclass
class StepMemory:
    """One rank's memory during a training step, in bytes."""

    peak: int  # the most allocated at once, on the device
    at_peak: dict[str, int]  # category -> bytes held at that moment
    category_max: dict[str, int]  # category -> the most it held at any moment (not at once)
    # With FSDP's CPU offload or activation offload: what lives in host memory at its peak (not in `peak`)
    host: int = 0
    raw: dict[str, int] = field(default_factory=dict)  # PyTorch's own reference types at the peak
    # MoE models: experts' parameters and optimizer state on the rank, one layer's dispatch buffers
    # (EXPERT_PARTS; module docstring); empty for dense models.
    experts: dict[str, int] = field(default_factory=dict)

    def add(self, category: str, nbytes: int) -> None:
        """Memory the tracker cannot see but the rank holds all along (e.g. DDP's buckets)."""
        self.at_peak[category] += nbytes
        self.category_max[category] += nbytes
        self.peak += nbytes

    def as_record(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak, "at_peak": self.at_peak, "category_max": self.category_max,
                "host_bytes": self.host, "tracker": self.raw, "experts": self.experts}


class StepTracker:
    """Tracks the memory of whatever runs inside `with tracker.tracking():`; `result()` then gives
    the peak. `offload`: FSDP's CPU offload is on (its host-side tensors are reported apart)."""

    def __init__(self, model_parts: list[nn.Module], optimizers: list[Any], offload: bool = False):
        self.offload = offload
        self.optimizers = optimizers
        self.moe_layers = [m for part in model_parts for m in part.modules() if is_moe_layer(m)]
        # FSDP's tracker needs every part to be an FSDP root. Where only some submodules are sharded
        # (MoE experts over their own mesh in a layout without FSDP), the plain tracker still sees
        # every allocation; their gathered parameters then count as temporaries.
        if all(isinstance(part, FSDPModule) for part in model_parts):
            self.tracker: MemTracker = FSDPPartsTracker(model_parts, optimizers)
        else:
            self.tracker = PartsTracker(model_parts)
            self.tracker.track_external(*model_parts, *optimizers)

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        with self.tracker:
            yield

    def track_inputs(self, *tensors: Any) -> None:
        if isinstance(self.tracker, FSDPMemTracker):
            self.tracker.track_inputs(tensors)
        else:
            self.tracker.track_external(*tensors)

    def result(self) -> StepMemory:
        raw: dict[str, int] = {}
        host = 0
        peaks = self.tracker.get_tracker_snapshot("peak")
        hosts = _host_devices(peaks)
        for device, snapshot in peaks.items():  # one device, and the host where activations are offloaded
            if device in hosts:
                host += snapshot.get(_TOTAL, 0)
                continue
            for kind, nbytes in snapshot.items():
                name = getattr(kind, "value", kind)
                raw[name] = raw.get(name, 0) + nbytes
        raw.pop("Total", None)
        host += sum(raw.get(k, 0) for k in _OFFLOADED) if self.offload else 0
        at_peak = dict.fromkeys(CATEGORIES, 0)
        for name, nbytes in raw.items():
            if self.offload and name in _OFFLOADED:
                continue
            at_peak[_CATEGORY_OF.get(name, "temporaries")] += nbytes
        category_max = dict.fromkeys(CATEGORIES, 0)
        for name, nbytes in self._category_maxima().items():
            category_max[_CATEGORY_OF.get(name, "temporaries")] += nbytes
        experts = self._experts() if self.moe_layers else {}
        return StepMemory(sum(at_peak.values()), at_peak, category_max, host, raw, experts)

    def _experts(self) -> dict[str, int]:
        """The experts' share and one MoE layer's dispatch buffers (module docstring)."""
        params = {p for layer in self.moe_layers for p in layer.experts.parameters()}
        state = [t for opt in self.optimizers for p in params for t in opt.state.get(p, {}).values()
                 if isinstance(t, torch.Tensor)]
        dispatch = 0
        for layer in self.moe_layers:
            # FSDP's tracker follows FSDP units only: under expert parallelism the experts are one.
            stats = self.tracker.memory_tracking.get(layer) or self.tracker.memory_tracking.get(layer.experts)
            if stats is None:
                continue
            by_state = {getattr(k, "value", k): v for k, v in stats.snapshots.items()}
            pre = by_state.get("Pre-Forward") or by_state.get("Before Pre-Forward", [])  # MemTracker's, FSDP's
            for before, peak in zip(pre, by_state.get("Peak-Forward") or by_state.get("Peak Forward", [])):
                for device, snapshot in peak.items():
                    dispatch = max(dispatch, _buffers(snapshot) - _buffers(before.get(device, {})))
        return {"expert parameters": sum(map(_local_bytes, params)), "expert optimizer": sum(map(_local_bytes, state)),
                "dispatch buffers": dispatch}

    def _category_maxima(self) -> dict[str, int]:
        """Each reference type's largest value over the step, from the tracker's per-module
        snapshots (taken before and after every module's forward and backward)."""
        maxima: dict[str, int] = {}
        hosts = _host_devices(self.tracker.get_tracker_snapshot("peak"))
        for stats in self.tracker.memory_tracking.values():
            for snapshots in stats.snapshots.values():
                for snapshot in snapshots:
                    for device, per_device in snapshot.items():
                        if device in hosts:
                            continue
                        for kind, nbytes in per_device.items():
                            name = getattr(kind, "value", kind)
                            if name != "Total":
                                maxima[name] = max(maxima.get(name, 0), nbytes)
        return maxima


def _host_devices(per_device: dict[torch.device, Any]) -> set[torch.device]:
    """The devices of a tracker snapshot that stand for host memory: activation offload's copies
    (parallelisms/activation_offload.py) go to the CPU from a GPU, and to the meta device in a dry
    run, whose fake tensors stand for the GPU's on the CPU."""
    on_gpu = any(device.type == "cuda" for device in per_device)
    return {device for device in per_device if device.type == "meta" or (on_gpu and device.type == "cpu")}


def is_moe_layer(module: nn.Module) -> bool:
    """A mixture-of-experts layer (torchtitan/models/moe.py's MoE, or a family's own with the same
    parts): it has `num_experts` and an `experts` submodule."""
    return hasattr(module, "num_experts") and isinstance(getattr(module, "experts", None), nn.Module)


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _buffers(snapshot: dict[Any, int]) -> int:
    """Bytes of activations and temporaries in one of the tracker's per-device snapshots."""
    return sum(nbytes for kind, nbytes in snapshot.items()
               if _CATEGORY_OF.get(getattr(kind, "value", kind)) in ("activations", "temporaries"))
