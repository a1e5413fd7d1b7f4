"""A fault for test_bad_inputs.py, loaded into the trainer with --experimental.custom_import:
TT_FAKE_FREE_BYTES=N makes every disk look as if it had N bytes free, so the checkpoint's
free-space check refuses the first save (a full disk, without filling one)."""

import os

from torchtitan.checkpoint import failures

if free := os.environ.get("TT_FAKE_FREE_BYTES"):
    failures.free_bytes = lambda path: int(free)
