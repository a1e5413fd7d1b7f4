"""Data parallelism's refusals that depend on the installed PyTorch (parallelisms/data_parallel.py)."""

import sys

import pytest
import torch

from torchtitan.errors import ConfigError
from torchtitan.parallelisms.data_parallel import apply_fsdp_replicate


def test_ddp_with_tp_or_pp_on_a_pytorch_without_fsdp_replicate_says_what_to_do(monkeypatch):
    """The FSDP-based replicate is a private PyTorch module (simulated missing: CI's PyTorch has it)."""
    monkeypatch.setitem(sys.modules, "torch.distributed._composable.replicate_with_fsdp", None)
    with pytest.raises(ConfigError) as e:
        apply_fsdp_replicate(torch.nn.Module(), mesh=None, reduce_dtype=torch.float32)
    assert str(e.value) == (f"DDP combined with tensor or pipeline parallelism needs PyTorch's FSDP-based replicate, "
                            f"which torch {torch.__version__} lacks; shard instead "
                            "(training.data_parallel_shard_degree > 1)")
