"""Data parallelism (parallelisms/data_parallel.py): refusals that depend on the installed PyTorch, and
FSDP's explicit forward prefetch."""

import copy
import sys

import pytest
import torch
from torch import nn

from torchtitan.errors import ConfigError
from torchtitan.parallelisms.data_parallel import apply_fsdp, apply_fsdp_replicate
from torchtitan.runtime.torch_compat.composable import forward_prefetch_targets, fsdp_param_groups


def test_ddp_with_tp_or_pp_on_a_pytorch_without_fsdp_replicate_says_what_to_do(monkeypatch):
    """The FSDP-based replicate is a private PyTorch module (simulated missing: CI's PyTorch has it)."""
    monkeypatch.setitem(sys.modules, "torch.distributed._composable.replicate_with_fsdp", None)
    with pytest.raises(ConfigError) as e:
        apply_fsdp_replicate(torch.nn.Module(), mesh=None, reduce_dtype=torch.float32)
    assert str(e.value) == (f"DDP combined with tensor or pipeline parallelism needs PyTorch's FSDP-based replicate, "
                            f"which torch {torch.__version__} lacks; shard instead "
                            "(training.data_parallel_shard_degree > 1)")


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(3)})
        self.output = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = torch.tanh(block(x))
        return self.output(x)


def test_fsdp_prefetches_the_next_block_asynchronously_and_computes_the_same(one_rank_mesh):
    """Each FSDP module (root, then every block) issues the next block's all-gather, asynchronously
    on CPU where FSDP2's default would block; forward and backward are bitwise those of the plain
    model."""
    torch.manual_seed(0)
    plain = _Blocks()
    model = copy.deepcopy(plain)
    apply_fsdp(model, one_rank_mesh, param_dtype=torch.float32, reduce_dtype=torch.float32,
               reshard_after_forward="default")
    blocks = list(model.layers.values())
    assert [forward_prefetch_targets(m) for m in (model, *blocks)] == [[b] for b in blocks] + [[]]
    assert all(g.unshard_async_op for m in (model, *blocks) for g in fsdp_param_groups(m))
    x = torch.randn(4, 8)
    outputs = [m(x) for m in (plain, model)]
    for out in outputs:
        out.square().sum().backward()
    assert torch.equal(outputs[0], outputs[1])
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad.full_tensor(), q.grad), name
