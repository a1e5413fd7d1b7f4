"""Helpers for tests that run the trainer as real processes (one process or torchrun ranks).

The runner and the tiny-run arguments come from torchtitan/tools/runs.py, so tests, the parity
harness and the scripts launch the trainer the same way.
"""

from __future__ import annotations

from pathlib import Path

from torchtitan.tools.runs import REPO_ROOT, read_metrics
from torchtitan.tools.runs import TINY_RUN as _TINY_RUN
from torchtitan.tools.runs import run_trainer as run_train

__all__ = ["REPO_ROOT", "TINY_RUN", "losses", "read_metrics", "run_train"]

TINY_RUN = list(_TINY_RUN)


def losses(dump_folder: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(dump_folder)]
