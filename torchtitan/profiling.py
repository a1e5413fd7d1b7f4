"""Profiler traces every `profiling.profile_freq` steps (chrome-trace JSON per rank)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Iterator

import torch

from torchtitan.job_config import JobConfig

logger = logging.getLogger(__name__)

# Of every profile_freq steps, the last ACTIVE are recorded after WARMUP steps of profiler warm-up.
WARMUP, ACTIVE = 1, 1


@contextlib.contextmanager
def maybe_enable_profiling(job_config: JobConfig, rank: int, global_step: int = 0) -> Iterator[torch.profiler.profile | None]:
    """Yields a profiler to `.step()` once per training step, or None when profiling is off.

    global_step is the step training resumes from, so trace folders carry true step numbers.
    """
    p = job_config.profiling
    if not p.enable_profiling:
        yield None
        return
    folder = os.path.join(job_config.job.dump_folder, p.save_traces_folder)
    wait = p.profile_freq - (WARMUP + ACTIVE)

    def save_trace(prof: torch.profiler.profile) -> None:
        step_folder = os.path.join(folder, f"iteration_{prof.step_num + global_step}")
        os.makedirs(step_folder, exist_ok=True)
        start = time.perf_counter()
        prof.export_chrome_trace(os.path.join(step_folder, f"rank{rank}_trace.json"))
        logger.info(f"profiler trace written to {step_folder} in {time.perf_counter() - start:.2f}s")

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    logger.info(f"profiling every {p.profile_freq} steps into {folder}")
    with torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=wait, warmup=WARMUP, active=ACTIVE),
        on_trace_ready=save_trace,
        record_shapes=True,
    ) as profiler:
        yield profiler
