"""Full disks for tests, loaded into the trainer with --experimental.custom_import (test_bad_inputs.py,
test_checkpoint_safety.py) or called in a test's own process:

- TT_FAKE_FREE_BYTES=N makes every disk look as if it had N bytes free, so the checkpoint's
  free-space check refuses the first save (a full disk, without filling one).
- TT_METRICS_DISK_FULL_AT_STEP=N: from the step line of step N on, the metrics files (metrics.jsonl,
  TensorBoard's event file) lie on a full disk: every write to them fails with the kernel's own
  ENOSPC, since their descriptors now point at /dev/full (`fill_disk_under`), as on a disk that
  fills up during training. Checkpoints are written elsewhere, as before.
"""

import os

from torchtitan.checkpoint import failures

if free := os.environ.get("TT_FAKE_FREE_BYTES"):
    failures.free_bytes = lambda path: int(free)


def fill_disk_under(files) -> None:
    """Points the open `files` at /dev/full: every later write or flush of theirs fails with ENOSPC."""
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        for f in files:
            if not f.closed:
                os.dup2(full, f.fileno())
    finally:
        os.close(full)


def noting_open(opened: list):
    """An `open` that notes every file it opens in `opened`: set as the metrics files module's own
    (`torchtitan.observability.metric_files.open`), it finds the files fill_disk_under points at /dev/full."""
    import builtins

    def open_and_note(*args, **kwargs):
        opened.append(builtins.open(*args, **kwargs))
        return opened[-1]

    return open_and_note


if at_step := os.environ.get("TT_METRICS_DISK_FULL_AT_STEP"):
    from torchtitan.observability import metric_files
    from torchtitan.observability.metrics import MetricsLogger

    _opened, _log = [], MetricsLogger.log
    metric_files.open = noting_open(_opened)  # shadows the builtin in that module only

    def log_on_a_full_disk(self, s):
        if s.step >= int(at_step):
            fill_disk_under(_opened)
        return _log(self, s)

    MetricsLogger.log = log_on_a_full_disk
