"""Checks at start-up that the run can write where its options say, before hours of training.

A dump or checkpoint folder that is a file, lies under a file, or sits on a read-only or
inaccessible disk would otherwise surface only at the first save, as a traceback, with the
trained steps lost. The check creates no folder (ranks start together, and the layout matrix runs
it in-process for layouts it never starts): it finds the nearest existing folder on the way and
proves it writable by creating and removing a probe file, which leaves nothing behind.
"""

from __future__ import annotations

import os
import tempfile

from torchtitan.config.job_config import JobConfig
from torchtitan.errors import ConfigError


def output_locations(job_config: JobConfig) -> list[tuple[str, str]]:
    """(option, path) of every folder this run will write into."""
    dump, checkpoint, metrics, profiling = job_config.job.dump_folder, job_config.checkpoint, job_config.metrics, job_config.profiling
    wanted = [
        ("checkpoint.folder", checkpoint.folder, checkpoint.enable_checkpoint or checkpoint.create_seed_checkpoint or checkpoint.last_save_in_hf),
        ("metrics.save_tb_folder", metrics.save_tb_folder, metrics.enable_tensorboard),
        ("profiling.save_traces_folder", profiling.save_traces_folder, profiling.enable_profiling),
        ("profiling.save_memory_snapshot_folder", profiling.save_memory_snapshot_folder, profiling.enable_memory_snapshot),
    ]
    return [("job.dump_folder", dump)] + [(option, os.path.join(dump, sub)) for option, sub, used in wanted if used]


def check_output_locations(job_config: JobConfig) -> None:
    """Raises ConfigError, naming the option and the path, if a folder the run writes into is a
    file, cannot be created, or cannot be written."""
    for option, path in output_locations(job_config):
        check_writable_folder(option, path)


def check_writable_folder(option: str, path: str) -> None:
    absolute = os.path.abspath(path)
    if os.path.islink(absolute) and not os.path.exists(absolute):  # e.g. to a file system not mounted
        raise ConfigError(f"{option} {path} is a broken symbolic link (to {os.readlink(absolute)})")
    if os.path.exists(absolute) and not os.path.isdir(absolute):
        raise ConfigError(f"{option} {path} is a file, not a folder")
    existing = absolute
    while not os.path.isdir(existing):  # the nearest folder that exists: the run will create the rest
        parent = os.path.dirname(existing)
        if os.path.islink(parent) and not os.path.exists(parent):
            raise ConfigError(f"{option} {path} cannot be created: {parent} is a broken symbolic link "
                              f"(to {os.readlink(parent)})")
        if os.path.exists(parent) and not os.path.isdir(parent):
            raise ConfigError(f"{option} {path} cannot be created: {parent} is a file")
        existing = parent
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=existing)
    except OSError as e:
        where = "" if existing == absolute else f" (its nearest existing folder {existing} is not writable)"
        raise ConfigError(f"{option} {path} is not writable: {e.strerror}{where}") from None
    os.close(fd)
    os.remove(probe)
