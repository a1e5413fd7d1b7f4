"""Activation offload: what chosen transformer blocks save for backward is kept in host memory.

During a block's forward, every tensor autograd saves for backward passes through a pack hook
(torch.autograd.graph.saved_tensors_hooks) that copies it to the host and lets the device copy go;
the unpack hook brings it back when backward needs it. Numerics do not change: the same values come
back, bit for bit, into tensors of the same shape and strides.

What stays on the device: parameters and views of them (FSDP frees and restores its unsharded
parameters itself, and a copy would free nothing), DTensors (tensor-parallel matmuls save their
inputs as DTensors; only plain tensors move), tensors below MIN_BYTES (a copy costs more than it
frees), and tensors that are not dense (a view of part of a larger tensor).

With activation checkpointing the wrapper sits outside the checkpoint: a block checkpointed in full
(or op-level) saves only its input through autograd, which is then what moves to the host; op-level
AC's kept matmul outputs live in the checkpoint's own cache and stay on the device.

On CUDA the device-to-host copy runs on a side stream into pinned memory, after the producing
stream's work (wait_stream) and holding the device memory until the copy is done (record_stream);
backward waits on the copy's event on the device and copies back without blocking the host. On the
CPU the "device" is host memory: the copy still runs (so exactness is tested on CPU), and saves
nothing. The dry run (fake tensors on the CPU standing for a GPU) sends the copies to the meta
device, which the memory tracker reports as host memory (estimation/tracker.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.runtime.torch_compat.autograd import tensor_version
from torchtitan.runtime.torch_compat.composable import ActivationWrapper, wrapped_module

logger = logging.getLogger(__name__)

# Smaller saved tensors stay on the device: 64 KiB takes about 3 us over PCIe 4, the order of a
# copy's launch cost, while a block's activations at training sizes are megabytes each.
MIN_BYTES = 64 * 1024


@dataclass
class OffloadStats:
    """What one offloader moved, in bytes; host_bytes is what its copies hold now. Counted from
    tensor metadata on the host (no device reads)."""

    tensors: int = 0  # saved tensors copied to the host
    bytes: int = 0  # their bytes, over all forwards
    host_bytes: int = 0  # held on the host now (copies not yet released by backward)
    peak_host_bytes: int = 0
    kept: int = 0  # saved tensors left on the device (parameters, DTensors, small or not dense)


class _Packed(NamedTuple):
    host: torch.Tensor
    device: torch.device
    copied: Any  # the CUDA event after the device-to-host copy, or None
    stats: OffloadStats


class _HostCopy:
    """Owns one host copy, so that the stats see it released when autograd drops it."""

    def __init__(self, packed: _Packed):
        self.packed = packed

    def __del__(self) -> None:
        self.packed.stats.host_bytes -= _nbytes(self.packed.host)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dense(t: torch.Tensor) -> bool:
    """Whether `t` covers its memory exactly once (any dim order): a copy with the same strides
    then holds exactly its elements."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.size()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    # PyTorch keeps one Python object per storage, so views of a tensor (and fake tensors, whose
    # storages have no address) share it by identity.
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()


class ActivationOffloader:
    """The pack and unpack hooks of one block. `host` is the device the copies go to: "cpu", or
    "meta" in a dry run (no memory, counted as host)."""

    def __init__(self, stats: OffloadStats, host: str = "cpu", min_bytes: int = MIN_BYTES):
        self.stats = stats
        self.host = torch.device(host)
        self.min_bytes = min_bytes
        self._stream: Any = None  # CUDA side stream for the device-to-host copies, made on first use
        self._kept_storages: set[torch.UntypedStorage] = set()  # during a forward only
        # One host copy per saved tensor, however often it is saved (RMSNorm saves its input twice),
        # during a forward only: (storage, offset, shape, strides, dtype, version) -> the copy.
        self._copies: dict[tuple, _HostCopy] = {}

    @contextlib.contextmanager
    def hooks(self, module: nn.Module, inputs: Iterable[Any] = ()) -> Iterator[None]:
        """The hooks for one forward of `module`. What stays where it is: its parameters (as they are
        now: FSDP has gathered them before the forward) and buffers and their views, and the inputs
        that need no gradient (RoPE tables, masks, shared by every block: a copy frees nothing)."""
        constants = [t for t in inputs if isinstance(t, torch.Tensor) and not t.requires_grad]
        self._kept_storages = {_storage(t) for t in (*module.parameters(), *module.buffers(), *constants)}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._kept_storages = set()
            self._copies = {}

    def _plain(self, t: torch.Tensor) -> bool:
        if isinstance(t, (nn.Parameter, DTensor)) or _nbytes(t) < self.min_bytes or not _dense(t):
            return False
        return _storage(t) not in self._kept_storages  # views of parameters share their storage

    def pack(self, t: torch.Tensor) -> Any:
        if not self._plain(t):
            self.stats.kept += 1
            return t
        key = (_storage(t), t.storage_offset(), tuple(t.size()), t.stride(), t.dtype, tensor_version(t))
        if key in self._copies:
            return self._copies[key]
        if t.device.type == "cuda" and self.host.type == "cpu":
            packed = self._to_pinned(t)
        else:
            # CPU (a real copy, in host memory like the original) or the dry run's meta device.
            host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=self.host)
            host.copy_(t)
            packed = _Packed(host, t.device, None, self.stats)
        nbytes = _nbytes(t)
        self.stats.tensors += 1
        self.stats.bytes += nbytes
        self.stats.host_bytes += nbytes
        self.stats.peak_host_bytes = max(self.stats.peak_host_bytes, self.stats.host_bytes)
        self._copies[key] = copy = _HostCopy(packed)
        return copy

    def _to_pinned(self, t: torch.Tensor) -> _Packed:
        if self._stream is None:
            self._stream = torch.cuda.Stream(t.device)
        stream = self._stream
        host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu", pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # after the op that made `t`
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # its memory is not reused until the copy is done
        return _Packed(host, t.device, stream.record_event(), self.stats)

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _HostCopy):
            return saved
        host, device, copied, _ = saved.packed
        if copied is not None:
            stream = torch.cuda.current_stream(device)
            stream.wait_event(copied)  # the device waits for the copy to the host, the host does not
            back = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=device)
            back.copy_(host, non_blocking=True)  # the pinned buffer's reuse waits for this copy too
            return back
        return host.to(device)  # on the CPU the copy itself (no second copy)


class OffloadWrapper(ActivationWrapper):
    """A block whose saved activations go to the host. Parameter names and state-dict keys are
    the bare block's (ActivationWrapper strips its prefix)."""

    def __init__(self, block: nn.Module, offloader: ActivationOffloader):
        super().__init__(block)
        self.offloader = offloader

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        block = wrapped_module(self)
        with self.offloader.hooks(block, (*args, *kwargs.values())):
            return block(*args, **kwargs)


def chosen_blocks(names: list[str], offload: str) -> list[str]:
    """The block names `offload` chooses: none, all, or every k-th block (index % k == 0, as
    activation_checkpoint.selective_ac_option's integer)."""
    if offload == "none":
        return []
    every = 1 if offload == "all" else int(offload)
    return [name for name in names if int(name) % every == 0]


def apply_offload(model: nn.Module, offload: str, min_bytes: int = MIN_BYTES) -> OffloadStats:
    """Wraps the chosen blocks of `model.layers` (after AC and compile, so the hooks sit outside
    both). Returns the stats all of them count into."""
    stats = OffloadStats()
    names = chosen_blocks(list(model.layers.keys()), offload)
    for name in names:
        block = model.layers[name]
        model.layers.register_module(name, OffloadWrapper(block, ActivationOffloader(stats, min_bytes=min_bytes)))
    if names:
        logger.info(f"applied activation offload to {len(names)} of {len(model.layers)} blocks")
    return stats


def offload_wrappers(model_parts: list[nn.Module]) -> list[OffloadWrapper]:
    return [m for part in model_parts for m in part.modules() if isinstance(m, OffloadWrapper)]


def count_as_host(model_parts: list[nn.Module]) -> None:
    """For a dry run on fake tensors: the copies go to the meta device (no memory, reported as
    host memory by the tracker) instead of the simulation's CPU, which stands for the GPU."""
    for wrapper in offload_wrappers(model_parts):
        wrapper.offloader.host = torch.device("meta")
