"""The memory a dry run's estimate is judged against, and where that figure comes from.

`memory_estimation.device_memory_gib` when given; else, for a job on CUDA, this machine's GPU (no
verdict on a machine without one: the estimate is printed alone); for a job on this CPU, the
host's available memory shared by the ranks the launcher starts here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from torchtitan.config.job_config import JobConfig
from torchtitan.estimation.memory_floor import rank_memory_bytes

GiB = 2**30
LOCAL_WORLD_SIZE_ENV = "TORCHTITAN_DRY_RUN_LOCAL_WORLD_SIZE"  # the launcher's NGPU: ranks on this host


@dataclass(frozen=True)
class DeviceMemory:
    """What one rank may use (None: unknown, no verdict) and where the figure comes from."""

    bytes: int | None
    source: str


def device_memory(job_config: JobConfig, target: str, world_size: int) -> DeviceMemory:
    given = job_config.memory_estimation.device_memory_gib
    if given > 0:
        return DeviceMemory(int(given * GiB), "memory_estimation.device_memory_gib")
    if target == "cuda":
        import torch

        if not torch.cuda.is_available():
            return DeviceMemory(None, "no GPU here to compare with: set memory_estimation.device_memory_gib")
        return DeviceMemory(rank_memory_bytes("cuda"), "this GPU's")
    if "LOCAL_WORLD_SIZE" in os.environ:  # a rank of a real job (memory_estimation.enabled)
        return DeviceMemory(rank_memory_bytes("cpu"), "this host's available memory shared by its ranks")
    available = rank_memory_bytes("cpu")  # this process alone
    local = max(1, int(os.environ.get(LOCAL_WORLD_SIZE_ENV, "0")) or world_size)
    return DeviceMemory(None if available is None else available // local,
                        f"this host's available memory shared by its {local} rank{'s' * (local > 1)}: the job runs on "
                        "this CPU")
