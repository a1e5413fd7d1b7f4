"""Profiler traces and CUDA memory snapshots every `profiling.profile_freq` steps (files per rank)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Iterator

import torch

from torchtitan.config.job_config import JobConfig
from torchtitan.errors import ConfigError
from torchtitan.runtime.torch_compat import memory as torch_compat_memory

logger = logging.getLogger(__name__)

# Of every profile_freq steps, the last ACTIVE are recorded after WARMUP steps of profiler warm-up.
WARMUP, ACTIVE = 1, 1


@contextlib.contextmanager
def maybe_enable_profiling(job_config: JobConfig, rank: int, global_step: int = 0) -> Iterator[torch.profiler.profile | None]:
    """Yields a profiler to `.step()` once per training step, or None when profiling is off.

    global_step is the step training resumes from, so trace folders carry true step numbers.
    """
    profiling = job_config.profiling
    if not profiling.enable_profiling:
        yield None
        return
    folder = os.path.join(job_config.job.dump_folder, profiling.save_traces_folder)
    wait = profiling.profile_freq - (WARMUP + ACTIVE)

    def save_trace(prof: torch.profiler.profile) -> None:
        step_folder = os.path.join(folder, f"iteration_{prof.step_num + global_step}")
        os.makedirs(step_folder, exist_ok=True)
        start = time.perf_counter()
        prof.export_chrome_trace(os.path.join(step_folder, f"rank{rank}_trace.json"))
        logger.info(f"profiler trace written to {step_folder} in {time.perf_counter() - start:.2f}s")

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    logger.info(f"profiling every {profiling.profile_freq} steps into {folder}")
    with torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=wait, warmup=WARMUP, active=ACTIVE),
        on_trace_ready=save_trace,
        record_shapes=True,
    ) as profiler:
        yield profiler


# Allocator events a snapshot keeps, the newest (torchtitan's figure): several steps of a large
# model; each event holds its stack trace in host memory.
MEMORY_SNAPSHOT_MAX_ENTRIES = 100_000


def check_memory_snapshot_support(job_config: JobConfig, device_type: str) -> None:
    """Refuses memory snapshots where there is no CUDA caching allocator to record, before any
    process group exists."""
    if job_config.profiling.enable_memory_snapshot and device_type != "cuda":
        raise ConfigError("profiling.enable_memory_snapshot records the CUDA caching allocator's history and needs a "
                          f"CUDA GPU; this job runs on {device_type} (leave it off here)")


class MemorySnapshot:
    """Dumps the CUDA allocator's recorded history after every step that is a multiple of
    `freq`, and once more when the run runs out of memory (see maybe_enable_memory_snapshot)."""

    def __init__(self, folder: str, rank: int, freq: int, global_step: int):
        self.folder, self.rank, self.freq = folder, rank, freq
        self.step_num = global_step  # the last step trained: a resumed run counts on from its checkpoint's

    def step(self) -> None:
        """Called once after each training step."""
        self.step_num += 1
        if self.step_num % self.freq == 0:
            self.dump(f"iteration_{self.step_num}")

    def dump(self, name: str) -> str:
        folder = os.path.join(self.folder, name)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        start = time.perf_counter()
        torch_compat_memory.dump_memory_snapshot(path)
        logger.info(f"memory snapshot written to {path} in {time.perf_counter() - start:.2f}s "
                    "(open it in https://pytorch.org/memory_viz)")
        return path


@contextlib.contextmanager
def maybe_enable_memory_snapshot(job_config: JobConfig, rank: int,
                                 global_step: int = 0) -> Iterator[MemorySnapshot | None]:
    """Yields a MemorySnapshot to `.step()` once per training step, or None when snapshots are off.

    Records the CUDA caching allocator's events (allocations, frees, with stack traces) from here
    on. A CUDA out-of-memory error leaving the block is dumped to iteration_<last step>_exit before
    it goes on: the history then shows what filled the memory. Recording stops when the block ends.
    """
    profiling = job_config.profiling
    if not profiling.enable_memory_snapshot:
        yield None
        return
    # preflight refused it already; a caller that skipped preflight gets the same line here.
    check_memory_snapshot_support(job_config, "cuda" if torch.cuda.is_available() else "cpu")
    snapshot = MemorySnapshot(os.path.join(job_config.job.dump_folder, profiling.save_memory_snapshot_folder), rank,
                              profiling.profile_freq, global_step)
    logger.info(f"recording CUDA memory history; a snapshot every {profiling.profile_freq} steps and at an out-of-memory "
                f"error, into {snapshot.folder}")
    torch_compat_memory.record_memory_history(MEMORY_SNAPSHOT_MAX_ENTRIES)
    try:
        yield snapshot
    except torch.OutOfMemoryError:
        try:
            path = snapshot.dump(f"iteration_{snapshot.step_num}_exit")
            logger.error(f"CUDA ran out of memory after step {snapshot.step_num}; its memory snapshot is {path}")
        except Exception as e:  # noqa: BLE001 - the out-of-memory error is the one to report
            logger.warning(f"CUDA ran out of memory and its memory snapshot could not be written: {e}")
        raise
    finally:
        torch_compat_memory.stop_memory_history()
