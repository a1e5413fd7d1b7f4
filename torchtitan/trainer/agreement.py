"""The ranks' once-per-step agreement, issued without waiting and read one step later.

Every step all ranks agree on three things: a stop signal some rank received (SIGINT, SIGTERM,
SIGUSR1), whether the step's loss or gradient norm is non-finite on some rank, and whether every
rank's background checkpoint write has finished. Reading that on the host at once would wait for
the step's last kernel (the gradient norm) and drain the device's queue every step. Instead the
flags are put together on the device (the non-finite one is computed there; the host's are
written by small kernels, never copied from pageable memory), maxed over all ranks by one
all-reduce on the device's stream, and copied without blocking to pinned host memory behind a CUDA
event. The host reads that copy during the next step, after the next step's forward and backward
were queued: it waits for the event, which the device passed long ago, never for the stream.

What keeps a non-finite step out of the model when the host learns of it a step late: the agreed
flag, still on the device, is the fused optimizer's `found_inf`, so the update is skipped by the
kernel itself (its step count rolled back) on every rank alike. Before the next step is applied,
the host reads the flag and stops the run (TrainingDiverged), as it did when it read it at once.

Steps that read on the host anyway (step lines, checkpoint saves, validation, the last step)
and set-ups whose optimizer cannot skip on the device (see `Trainer.skips_on_device`) settle their
own agreement at once, so those steps behave exactly as before.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan.observability import host_reads


@dataclass
class Agreed:
    """What all ranks agreed on for one step."""

    step: int
    stop_signal: int  # the stop signal some rank received (0: none)
    nonfinite: bool  # the loss or gradient norm was non-finite on some rank
    saves_done: bool  # every rank's background checkpoint write (the same one) had finished
    save_id: int  # which background write that was (CheckpointManager.background_save)
    loss: torch.Tensor  # the step's own, for the message of a non-finite step
    grad_norm: torch.Tensor


@dataclass
class Issued:
    """One step's agreement on its way: `found_inf` is the agreed non-finite flag on the device (a
    0-dim float tensor, 1.0 when the step must not be applied), for the fused optimizer."""

    step: int
    found_inf: torch.Tensor
    host: torch.Tensor  # the agreed flags' copy in (pinned) host memory
    event: torch.cuda.Event | None  # recorded after the copy (CUDA)
    save_id: int
    loss: torch.Tensor
    grad_norm: torch.Tensor


class StepAgreement:
    """Issues a step's agreement (`issue`) and reads it (`read`), at once or a step later."""

    def __init__(self, device: torch.device, check_finite: bool):
        self.device = device
        self.check_finite = check_finite  # training.on_nonfinite_loss == "stop"

    def issue(self, step: int, stop_signal: int, save: tuple[bool, int], loss: torch.Tensor,
              grad_norm: torch.Tensor) -> Issued:
        """Starts step `step`'s agreement. `save`: whether this rank's background checkpoint write is
        still running (or none is), and which one it is (CheckpointManager.background_save)."""
        running, save_id = save
        host_flags = torch.tensor([float(stop_signal), float(running)], dtype=torch.float32,
                                  pin_memory=self.device.type == "cuda")
        flags = torch.empty(3, dtype=torch.float32, device=self.device)
        flags[:2].copy_(host_flags, non_blocking=True)  # from pinned memory: an asynchronous copy
        if self.check_finite:
            finite = torch.isfinite(grad_norm.detach()) & torch.isfinite(loss.detach())
            flags[2] = (~finite).float()  # computed on the device: the loss and norm stay there
        else:
            flags[2] = 0.0
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # NCCL: queued on the stream; gloo: done on return
        event = None
        if self.device.type == "cuda":
            host = torch.empty(3, dtype=torch.float32, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = flags
        return Issued(step, flags[2], host, event, save_id, loss, grad_norm)

    def read(self, issued: Issued, deferred: bool) -> Agreed:
        """The agreed flags on the host. `deferred`: read a step after they were issued, when the
        wait is for an event the device passed long ago (not a stall, for the host-read audit)."""
        if issued.event is not None:
            if not deferred:
                host_reads.waited("event wait")  # waits for this step's kernels: a stall the audit must count
            issued.event.synchronize()
        with host_reads.deferred_read() if deferred else contextlib.nullcontext():
            stop_signal, running, nonfinite = issued.host.tolist()
        return Agreed(issued.step, int(stop_signal), bool(nonfinite), not running, issued.save_id,
                      issued.loss, issued.grad_norm)
