"""Fixtures the unit tests share."""

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


@pytest.fixture
def one_rank_mesh():
    """A one-rank gloo process group in this process and a 1-D mesh named dp_shard over it: enough
    for FSDP and DTensor code paths that need a process group but no peers."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()
