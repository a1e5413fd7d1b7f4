"""Imported through experimental.custom_import by a test: rank 1's optimizer step takes 0.15 s
longer, as on a rank with a slow host (the straggler report must name it)."""

import os
import time

from torchtitan.trainer.optimizer import OptimizersContainer

DELAY_SECONDS = 0.15

if os.environ.get("RANK") == "1":
    _step = OptimizersContainer.step

    def _slow_step(self, *args, **kwargs) -> None:
        time.sleep(DELAY_SECONDS)
        _step(self, *args, **kwargs)

    OptimizersContainer.step = _slow_step
