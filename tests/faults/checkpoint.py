"""Faults for checkpoint tests, loaded into the trainer with --experimental.custom_import.

Which fault, and when, comes from environment variables (each rank reads them at import):

- TT_KILL_AFTER_STEP=N: rank 0 is killed (SIGKILL) right after step N, as a machine failure would.
- TT_KILL_IN_SAVE=N:write: rank 0 is killed while DCP writes step N's checkpoint (its data files
  are on disk, its .metadata is not).
- TT_KILL_IN_SAVE=N:publish: rank 0 is killed after writing step N's manifest, before the folder
  is renamed to step-N.

- TT_SIGTERM_IN_VALIDATION=N: rank 0 sends itself SIGTERM (a preemption) while validating step N.
- TT_SIGTERM_AT_STEP=N:R: rank R sends itself SIGTERM during step N's optimizer step, after the
  ranks' agreement of step N was issued (so the agreement of step N + 1 is the first to carry it).

- TT_WRITE_FAILS=N:R:ERRNO: rank R's DCP write of step N's checkpoint fails with OSError ERRNO
  (ENOSPC: a full disk; EROFS: a read-only one), as the file system would report it.

It also registers what some tests need beyond the built-in models: a Llama flavor with a
narrower width (`tiny_narrow`), and a model `llama3_nan` whose loss turns NaN from the
step given by TT_NAN_FROM_STEP on.
"""

import dataclasses
import errno
import os
import signal

from torch.distributed.checkpoint.filesystem import FileSystemWriter

from torchtitan.checkpoint import manager
from torchtitan.models import get_train_spec, register_train_spec


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


if step := os.environ.get("TT_KILL_AFTER_STEP"):
    _save = manager.CheckpointManager.save

    def save_then_die(self, step_done, **kwargs):
        _save(self, step_done, **kwargs)
        if step_done == int(step):
            # An async save may still be writing; publishing it is collective, so every rank waits.
            self._publish_finished_async_save()
            if _rank0():
                _die()

    manager.CheckpointManager.save = save_then_die

if fault := os.environ.get("TT_KILL_IN_SAVE"):
    kill_step, where = fault.split(":")
    marker = f"step-{kill_step}.partial-"

    if where == "write":
        _finish = FileSystemWriter.finish

        def finish_or_die(self, *args, **kwargs):
            if marker in str(self.path) and _rank0():
                _die()
            return _finish(self, *args, **kwargs)

        FileSystemWriter.finish = finish_or_die
    else:
        _rename = os.rename

        def rename_or_die(src, dst, *args, **kwargs):
            if marker in str(src) and os.path.basename(str(dst)).startswith("step-"):
                _die()
            return _rename(src, dst, *args, **kwargs)

        os.rename = rename_or_die  # publish() renames through os.rename; only its last rename dies

if fault := os.environ.get("TT_WRITE_FAILS"):
    fail_step, fail_rank, fail_errno = fault.split(":")
    _write_data = FileSystemWriter.write_data

    def write_data_or_fail(self, *args, **kwargs):
        if f"step-{fail_step}.partial-" in str(self.path) and os.environ.get("RANK", "0") == fail_rank:
            code = getattr(errno, fail_errno)
            raise OSError(code, os.strerror(code), os.path.join(str(self.path), f"__{fail_rank}_0.distcp"))
        return _write_data(self, *args, **kwargs)

    FileSystemWriter.write_data = write_data_or_fail

if at_step := os.environ.get("TT_SIGTERM_AT_STEP"):
    from torchtitan.trainer.optimizer import OptimizersContainer

    _step_at, _rank_at = map(int, at_step.split(":"))
    _optimizer_step = OptimizersContainer.step
    _steps_done = [0]

    def step_then_signal(self, *args, **kwargs):
        _steps_done[0] += 1
        if _steps_done[0] == _step_at and os.environ.get("RANK", "0") == str(_rank_at):
            os.kill(os.getpid(), signal.SIGTERM)
        return _optimizer_step(self, *args, **kwargs)

    OptimizersContainer.step = step_then_signal

if signal_step := os.environ.get("TT_SIGTERM_IN_VALIDATION"):
    from torchtitan.trainer import validation

    _loss = validation.Validator._loss

    def loss_then_signal(self, *args):
        if self.validating_step == int(signal_step) and _rank0():
            os.kill(os.getpid(), signal.SIGTERM)
        return _loss(self, *args)

    _run = validation.Validator.run

    def run_noting_step(self, step_done, *args, **kwargs):
        self.validating_step = step_done
        return _run(self, step_done, *args, **kwargs)

    validation.Validator._loss, validation.Validator.run = loss_then_signal, run_noting_step

llama3 = get_train_spec("llama3")
llama3.config["tiny_narrow"] = dataclasses.replace(llama3.config["tiny"], dim=64, n_heads=8, n_kv_heads=4)

if nan_step := os.environ.get("TT_NAN_FROM_STEP"):
    calls = {"n": 0}

    def nan_loss(logits, labels):
        calls["n"] += 1
        loss = llama3.loss_fn(logits, labels)
        return loss * float("nan") if calls["n"] >= int(nan_step) else loss

    register_train_spec(dataclasses.replace(llama3, name="llama3_nan", loss_fn=nan_loss))

