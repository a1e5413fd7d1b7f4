"""CUDA memory history and snapshots (what https://pytorch.org/memory_viz opens)."""

from __future__ import annotations

import torch

from torchtitan.runtime.torch_compat import CPU_AND_GPU_CHECK, PrivateName

PRIVATE_NAMES = (
    PrivateName("torch.cuda.memory._record_memory_history", ("enabled", "context", "stacks", "max_entries"),
                checked=CPU_AND_GPU_CHECK),
    PrivateName("torch.cuda.memory._dump_snapshot", ("filename",), checked=CPU_AND_GPU_CHECK),
)


def record_memory_history(max_entries: int) -> None:
    """Starts recording the CUDA caching allocator's events with stack traces. The snapshot API is
    private in torch 2.11-2.13 (`torch.cuda.memory._record_memory_history`), documented by PyTorch's
    "Understanding CUDA Memory Usage" page as the way to take one."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def stop_memory_history() -> None:
    """Stops recording (and drops the history)."""
    torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: str) -> None:
    """Writes the recorded history and the allocator's state to `path` (memory_viz's pickle)."""
    torch.cuda.memory._dump_snapshot(path)
