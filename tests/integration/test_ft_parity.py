"""Fault-tolerant replica groups without a failure train like one process: two groups of one rank,
joined by torchft, average their gradients each step as one job's two data-parallel replicas
would. The groups' mean loss per step matches the single-process baseline within the parity
tolerance, the gradient norm (taken after the cross-group average) too, and both groups hold the
same weights at the end."""

import pytest

from torchtitan.tools.parity import local_batch_size
from torchtitan.tools.replica_groups import lighthouse, run_replica_groups
from torchtitan.tools.runs import read_metrics

pytest.importorskip("torchft")

GROUPS = 2


@pytest.mark.budget("two replica groups of real processes joined by a lighthouse, plus the shared baseline")
def test_fault_tolerant_groups_train_like_one_process(parity, tmp_path):
    batch = local_batch_size(parity.global_batch, (), GROUPS)
    with lighthouse(min_replicas=GROUPS) as address:
        args = [*parity.common_args(), "--training.batch_size", str(batch), "--checkpoint.enable_checkpoint",
                "--checkpoint.interval", str(parity.steps), "--fault_tolerance.enable",
                "--fault_tolerance.group_size", str(GROUPS), "--fault_tolerance.min_replica_size", str(GROUPS),
                "--fault_tolerance.lighthouse", address, "--job.dump_folder", str(tmp_path)]
        run_replica_groups(args, GROUPS, timeout=240)
    base = parity.baseline().records
    groups = [read_metrics(tmp_path / f"replica_{g}") for g in range(GROUPS)]
    assert all([r["step"] for r in g] == [r["step"] for r in base] for g in groups)
    assert all(r["replicas"] == GROUPS for g in groups for r in g)
    mean_losses = [sum(g[i]["loss"] for g in groups) / GROUPS for i in range(len(base))]
    diffs = [abs(a - b["loss"]) for a, b in zip(mean_losses, base)]
    print(f"fault-tolerant groups vs one process: max |loss diff| {max(diffs):.2e}")
    assert max(diffs) <= parity.loss_tolerance, diffs
    for g in groups:  # the norm is of the averaged gradients: every group's equals one process's
        assert abs(g[-1]["grad_norm"] - base[-1]["grad_norm"]) <= parity.grad_norm_rtol * base[-1]["grad_norm"]
    assert groups[0][-1]["grad_norm"] == groups[1][-1]["grad_norm"]
    # The groups' final weights are the same, bit for bit.
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    weights = []
    for g in range(GROUPS):
        out = tmp_path / f"weights_{g}.pt"
        dcp_to_torch_save(tmp_path / f"replica_{g}" / "checkpoint" / f"step-{parity.steps}", out)
        weights.append(torch.load(out, weights_only=False)["model"])
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
