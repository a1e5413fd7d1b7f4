"""Host reads of an MoE layer, as HostReadAudit counts them (docs/performance.md, "Host reads of
MoE layers"): none in the
dropping mode, with or without expert parallelism (a one-rank gloo group runs EP's real dispatch
in-process); dropless exactly the documented count per layer (0 with the grouped kernel, 1 with
the loop or with EP's split sizes, 2 with both); the statistics after each step read nothing on
steps that do not log."""

import types

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from torchtitan.models.moe import MoE
from torchtitan.observability.host_reads import HostReadAudit
from torchtitan.parallelisms.expert_parallel import apply_expert_parallel, moe_after_step

DIM, HIDDEN, EXPERTS, TOP_K = 16, 24, 4, 2  # multiples of 8: torch._grouped_mm runs them on CPU in fp32


@pytest.fixture
def ep_mesh():
    """A one-rank EP mesh of a one-process gloo group: EP's dispatch, all-to-alls included, runs here."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    finally:
        dist.destroy_process_group()


def make_moe(capacity_factor, use_grouped_mm):
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, EXPERTS, TOP_K, capacity_factor=capacity_factor, aux_loss_coef=0.1)
    moe.init_weights(0.02)
    with torch.no_grad():
        moe.router.gate.weight.normal_(0, 0.5)  # unbalanced routing: some experts overflow
    moe.experts.use_grouped_mm = use_grouped_mm
    return moe


def reads(audit):
    """(op, file, function) of each read the audit saw (line numbers left out)."""
    return [(r.op, r.where.split(":")[0], r.where.rsplit(" ", 1)[1]) for r in audit.reads]


def reads_of_a_step(moe):
    """The host reads of one forward and backward of the layer (inputs made outside the audit)."""
    x = torch.randn(2, 12, DIM, requires_grad=True)
    g = torch.randn(2, 12, DIM)
    with HostReadAudit() as audit:
        (moe(x) * g).sum().backward()
    return reads(audit)


@pytest.mark.parametrize("use_grouped_mm", [None, False])
def test_the_dropping_mode_reads_nothing_with_or_without_expert_parallelism(ep_mesh, use_grouped_mm):
    local, sharded = make_moe(1.0, use_grouped_mm), make_moe(1.0, use_grouped_mm)
    apply_expert_parallel([sharded], ep_mesh)
    assert reads_of_a_step(local) == []
    assert reads_of_a_step(sharded) == []
    assert local.take_step_stats().dropped_tokens > 0  # the mode did drop: its bookkeeping ran


@pytest.mark.parametrize("use_grouped_mm, ep, expected", [
    (None, False, []),
    (False, False, [("tolist", "torchtitan/models/moe.py", "forward")]),
    (None, True, [("tolist", "torchtitan/parallelisms/expert_parallel.py", "exchange_counts")]),
    (False, True, [("tolist", "torchtitan/parallelisms/expert_parallel.py", "exchange_counts"),
                   ("tolist", "torchtitan/models/moe.py", "forward")]),
])
def test_dropless_reads_the_documented_count(ep_mesh, use_grouped_mm, ep, expected):
    moe = make_moe(0.0, use_grouped_mm)
    if ep:
        apply_expert_parallel([moe], ep_mesh)
    assert reads_of_a_step(moe) == expected


def _model_with(moe):
    part = nn.Module()
    part.layers = nn.ModuleDict({"0": nn.ModuleDict({"moe": moe})})
    return part


def test_the_statistics_after_a_step_read_only_on_logging_steps():
    from torchtitan.models.deepseek_v3.after_step import deepseek_v3_after_step

    moe = make_moe(0.5, None)
    one_process = types.SimpleNamespace(stage_mesh=None, pp_enabled=False, pp=1, moe_gradient_divide_factor=1)
    for after_step in (moe_after_step, deepseek_v3_after_step):
        moe(torch.randn(2, 12, DIM))
        with HostReadAudit() as audit:
            assert after_step([_model_with(moe)], one_process, log=False) is None
        assert audit.reads == []
        moe(torch.randn(2, 12, DIM))
        with HostReadAudit() as audit:
            values, _ = after_step([_model_with(moe)], one_process, log=True)
        assert values["moe_dropped_tokens/layer0"] > 0 and audit.reads
        assert all(r.scheduled for r in audit.reads)  # marked as a logging step's, outside the steady state
