"""The one interface the training loop talks to replica groups through (fault_tolerance.*), with a
do-nothing default for a run without fault tolerance, and what train.py asks of replica groups
before the loop (the group's outputs, its data coordinates, the ledger's shape). train.py joins
the groups after the checkpoint load: fault_tolerance.join_replica_groups, then
semi_sync.join_semi_sync.

The loop (trainer/loop.py) calls, every step and whatever the mode:

    start_step()                  before the batch is drawn
    draw(next_batch)              the step's batch
    average_gradients(params)     after backward, before the gradient norm
    commit() -> bool              after the ranks agreed to go on, before the update: apply it?
                                  (False: the step is tried again; the step count may have moved
                                  to the peers' after a live recovery)
    after_update(step) -> bool    after the update and the LR step: does the step stand?
                                  (False: it was undone, the counters are back at the last sync)

Three implementations: ReplicaStep itself (one job, nothing to meet: the batch is the next one,
every step is applied and stands), ReplicaGroups (fault_tolerance.py: the groups average their
gradients and commit every step, fault-tolerant HSDP) and SemiSync (semi_sync.py: each group
steps alone and the groups sync parameters every fault_tolerance.sync_steps steps in after_update).
"""

from __future__ import annotations

import os
from typing import Any, Callable

from torch import nn

from torchtitan.config.job_config import JobConfig


class ReplicaStep:
    """Without fault tolerance: a single job, which every step is applied in and stands."""

    # Whether every step must read the ranks' agreement before its update: a step committed across
    # groups cannot be applied first and found non-finite a step later.
    settles_every_step = False

    def start_step(self) -> None:
        """Before the step's batch is drawn."""

    def draw(self, next_batch: Callable[[], Any]) -> Any:
        """The step's batch."""
        return next_batch()

    def average_gradients(self, params: list[nn.Parameter]) -> None:
        """After backward: the gradients averaged with the other groups."""

    def commit(self) -> bool:
        """Before the update: whether to apply it."""
        return True

    def after_update(self, step: int) -> bool:
        """After the update and the LR step: whether step `step` stands."""
        return True

    def step_line(self) -> tuple[dict[str, Any], str]:
        """What the step line and metrics.jsonl add: values and text."""
        return {}, ""

    def log_summary(self) -> None:
        """At the end of the run."""

    def close(self) -> None:
        """When the run ends, however it ends."""


def replica_dump_folder(config: JobConfig) -> str:
    """The folder this rank writes to: with fault tolerance <job.dump_folder>/replica_<id>, each
    group's logs, metrics, checkpoints and data positions; else job.dump_folder."""
    if not config.fault_tolerance.enable:
        return config.job.dump_folder
    return os.path.join(config.job.dump_folder, f"replica_{config.fault_tolerance.replica_id}")


def empty_ledger(config: JobConfig) -> list[int]:
    """TrainState.data_consumed before any step: a count per replica group (none without fault tolerance)."""
    return [0] * config.fault_tolerance.group_size if config.fault_tolerance.enable else []


def data_coordinates(config: JobConfig, dp_rank: int, dp_degree: int) -> tuple[int, int]:
    """The data-parallel coordinates the data is sharded by: with fault tolerance every group's ranks
    read their own shards, as the data-parallel ranks of one HSDP job with the groups as replicas
    would (group g's rank r reads shard g x dp + r of group_size x dp)."""
    ft = config.fault_tolerance
    if not ft.enable:
        return dp_rank, dp_degree
    return ft.replica_id * dp_degree + dp_rank, ft.group_size * dp_degree
