"""The host-read audit (torchtitan/observability/host_reads.py) and the one-step-late agreement it
proves (torchtitan/trainer/agreement.py): what counts as a read, where it is attributed, and that
a non-finite step is skipped on the device without the host reading anything first."""

import threading

import pytest
import torch
from torch import nn

from torchtitan.observability import host_reads
from torchtitan.observability.host_reads import HostReadAudit
from torchtitan.trainer.agreement import StepAgreement
from torchtitan.trainer.optimizer import OptimizersContainer

HERE = "test_host_reads.py"


def test_each_kind_of_read_is_counted_with_its_line_step_and_phase():
    x = torch.arange(6.0)
    with HostReadAudit() as audit:
        audit.mark(3, "forward/backward")
        x.sum().item()
        bool(x[0] > 1)
        x.tolist()
        x[x > 2]  # a boolean mask: its true entries are counted to size the result
        y = x.clone()
        y[x > 4] = 0.0
        y.masked_fill_(x > 4, 0.0)  # the same without a read
        torch.nonzero(x)
        torch.unique(x)
        x.repeat_interleave(torch.tensor([1, 1, 1, 1, 1, 2]))
        x.repeat_interleave(torch.tensor([1, 1, 1, 1, 1, 2]), output_size=7)  # sized by the caller: no read
        x * 2 + 1  # device work only
        audit.mark(4, "logging")
        float(x.mean())
    ops = [r.op for r in audit.reads]
    assert ops == ["item", "item", "tolist", "boolean mask", "boolean mask", "nonzero", "unique", "repeat_interleave",
                   "item"]
    assert all(r.where.startswith(HERE) for r in audit.reads), [r.where for r in audit.reads]
    assert [(r.step, r.phase) for r in audit.reads][-2:] == [(3, "forward/backward"), (4, "logging")]
    assert torch.Tensor.tolist is not None and "wrapped" not in repr(torch.Tensor.tolist)  # given back on exit
    assert HostReadAudit().reads == [] and host_reads._ACTIVE is None


def test_steady_state_leaves_out_the_first_step_and_deferred_and_scheduled_reads():
    x = torch.ones(2)
    with HostReadAudit() as audit:
        for step in (1, 2, 3):
            host_reads.mark(step, "gradient norm")
            x.sum().item()  # a stall every step
            with host_reads.deferred_read():
                x.tolist()  # a copy made a step earlier
            if step == 3:
                with host_reads.scheduled_read():
                    x.max().item()  # the step line's
    assert len(audit.reads) == 7
    steady = audit.steady_state(first_step=1)
    assert [(r.step, r.op) for r in steady] == [(2, "item"), (3, "item")]
    report = audit.report(first_step=1)
    assert (report["stalls"], report["deferred"], report["scheduled"], report["steady_state"]) == (4, 3, 1, 2)
    assert report["per_step"] == {"1": 1, "2": 1, "3": 2}


def test_reads_of_other_threads_are_not_on_the_step_path():
    with HostReadAudit() as audit:
        worker = threading.Thread(target=lambda: torch.ones(3).tolist())
        worker.start()
        worker.join()
    assert audit.reads == []


def test_maybe_audit_writes_its_report_and_logs_one_line(tmp_path):
    lines = []
    path = tmp_path / "host_reads" / "rank0.json"
    with host_reads.maybe_audit(True, str(path), first_step=1, log=lines.append):
        host_reads.mark(2, "optimizer step")
        torch.ones(1).item()
    assert path.exists() and len(lines) == 1
    assert lines[0].startswith("host reads: 1 in steady-state steps") and f"{HERE}:" in lines[0]
    with host_reads.maybe_audit(False, str(tmp_path / "off.json"), first_step=1) as audit:
        torch.ones(1).item()
    assert audit is None and not (tmp_path / "off.json").exists()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_the_agreement_flags_a_nonfinite_step_on_the_device_and_reads_it_later(bad):
    agreement = StepAgreement(torch.device("cpu"), check_finite=True)
    with HostReadAudit() as audit:
        audit.mark(5, "agreeing to go on")
        ok = agreement.issue(5, stop_signal=0, save=(True, 0), loss=torch.tensor(2.0), grad_norm=torch.tensor(1.0))
        bad_step = agreement.issue(6, stop_signal=15, save=(False, 1), loss=torch.tensor(bad),
                                   grad_norm=torch.tensor(1.0))
    assert audit.reads == []  # issuing reads nothing on the host
    assert ok.found_inf.item() == 0.0 and bad_step.found_inf.item() == 1.0
    first, second = agreement.read(ok, deferred=True), agreement.read(bad_step, deferred=False)
    assert (first.step, first.stop_signal, first.nonfinite, first.saves_done) == (5, 0, False, False)
    assert (second.step, second.stop_signal, second.nonfinite, second.saves_done, second.save_id) == (6, 15, True, True, 1)
    unchecked = StepAgreement(torch.device("cpu"), check_finite=False)  # training.on_nonfinite_loss continue
    assert unchecked.issue(1, 0, (True, 0), torch.tensor(bad), torch.tensor(bad)).found_inf.item() == 0.0


class _Part(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 3)


def _optimizers(part: nn.Module) -> OptimizersContainer:
    return OptimizersContainer([part], torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.1, "fused": True})


def _grads(part: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in part.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_a_flagged_step_is_skipped_by_the_fused_optimizer_and_an_unflagged_one_is_bitwise_unchanged():
    plain, flagged = _Part(), _Part()
    plain_opt, flagged_opt = _optimizers(plain), _optimizers(flagged)
    for step in range(3):
        _grads(plain, step)
        _grads(flagged, step)
        plain_opt.step()
        flagged_opt.step(torch.zeros(()))  # found_inf 0: the same update, bit for bit
    for a, b in zip(plain.parameters(), flagged.parameters()):
        assert torch.equal(a, b)
    before = {n: p.detach().clone() for n, p in flagged.named_parameters()}
    state = {k: {n: v.clone() for n, v in s.items()} for k, s in flagged_opt.optimizers[0].state.items()}
    _grads(flagged, 99)
    with HostReadAudit() as audit:
        flagged_opt.step(torch.ones(()))  # found_inf 1: nothing changes, the step count included
    assert [r for r in audit.reads if "torchtitan" in r.where] == []
    assert all(torch.equal(before[n], p) for n, p in flagged.named_parameters())
    for k, s in flagged_opt.optimizers[0].state.items():
        assert all(torch.equal(state[k][n], v) for n, v in s.items()), k


def test_the_vocabulary_masks_write_what_torch_writes_without_reading():
    from torch.distributed.tensor import placement_types
    from torch.distributed.tensor._ops._mask_buffer import MaskBuffer

    from torchtitan.runtime.torch_compat import dtensor_masks

    dtensor_masks.mask_without_host_reads()
    dtensor_masks.mask_without_host_reads()  # idempotent: the originals stay torch's
    torch_mask_tensor, torch_apply_mask = (dtensor_masks.TORCH_ORIGINALS[k] for k in ("mask_tensor", "apply_mask"))
    assert "torchtitan" not in torch_mask_tensor.__module__ and "torchtitan" not in torch_apply_mask.__module__
    ids = torch.randint(0, 64, (3, 17))
    for offset, size in ((0, 16), (16, 16), (48, 16)):
        with HostReadAudit() as audit:
            mask, masked = placement_types._MaskPartial._mask_tensor(ids, offset, size)
        assert audit.reads == []
        ref_mask, ref_masked = torch_mask_tensor(ids, offset, size)
        assert torch.equal(mask, ref_mask) and torch.equal(masked, ref_masked)
        for out in (torch.randn(3, 17), torch.randn(3, 17, 8)):  # a gather's output, an embedding's rows
            ours, theirs = MaskBuffer(), MaskBuffer()
            ours.materialize_mask(mask)
            theirs.materialize_mask(mask)
            mine, ref = out.clone(), out.clone()
            with HostReadAudit() as audit:
                ours.apply_mask(mine)
            torch_apply_mask(theirs, ref)
            assert audit.reads == [] and torch.equal(mine, ref)
    with pytest.raises(RuntimeError, match="not been materialized"):
        MaskBuffer().apply_mask(torch.zeros(2))
