"""Pipeline parallelism, model-independent parts: schedules, stage placement, microbatches, splits.

A model family's `pipelining_fn` (e.g. `pipeline_llama`) cuts its model into stage modules with
the plan made here and builds the schedule with `pipeline_runtime`. Everything that needs no
process group (schedule names, stage and microbatch counts, split points) is checked by
`plan_pipeline` before any group exists, because a pipeline whose ranks disagree about the
schedule does not fail: it hangs.

Free of torch, so that the launcher's pre-flight check can validate without importing it.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Sequence

from torchtitan.assets import resolve_path
from torchtitan.config.job_config import JobConfig
from torchtitan.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduleKind:
    multi_stage: bool  # runs several stages per rank (PipelineScheduleMulti)
    v_shape: bool  # stages placed V-wise: rank r holds stages r and (num_stages - 1 - r)
    per_round: bool  # microbatches run in rounds of pp, so their count must be a multiple of pp
    min_microbatches: str  # "one", "pp", or "stages" (pp x stages per rank)
    split_backward: bool = False  # runs input and weight gradients as two backward passes (zero bubble)


# Every schedule PyTorch ships (torch.distributed.pipelining), keyed by the name users type.
SCHEDULES: dict[str, ScheduleKind] = {
    "GPipe": ScheduleKind(False, False, False, "one"),
    "1F1B": ScheduleKind(False, False, False, "stages"),
    "Interleaved1F1B": ScheduleKind(True, False, True, "pp"),
    "LoopedBFS": ScheduleKind(True, False, False, "one"),
    "InterleavedZeroBubble": ScheduleKind(True, False, True, "pp", split_backward=True),
    "ZBVZeroBubble": ScheduleKind(True, True, False, "stages", split_backward=True),
    "DualPipeV": ScheduleKind(True, True, False, "stages", split_backward=True),
}
CSV_SCHEDULE = "CSV"


def theoretical_bubble(name: str, p: int, m: int, v: int) -> float | None:
    """Idle fraction of a schedule with p ranks, m microbatches and v stages per rank (None where
    the schedule fills its bubble with deferred weight-gradient work, so it depends on timing)."""
    formula = {
        "GPipe": (p - 1) / (m + p - 1),
        "1F1B": (p - 1) / (m + p - 1),
        # Each rank runs all m microbatches through one of its stages before the next; a later
        # loop waits only while m < p (its input comes round after p chunk-times).
        "LoopedBFS": 1 - v * m / ((v - 1) * max(m, p) + m + p - 1),
        "Interleaved1F1B": (p - 1) / (v * m + p - 1),
    }
    return formula.get(name)


def _canonical(name: str) -> str | None:
    return {k.lower(): k for k in SCHEDULES}.get(name.lower())


@dataclass(frozen=True)
class PipelinePlan:
    """What every pp rank must agree on: derived once from the config, identically everywhere."""

    schedule: str  # a SCHEDULES key, or CSV_SCHEDULE
    pp: int
    stages_per_rank: int
    microbatches: int

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    split_backward: bool = False  # input and weight gradients in two backward passes (zero bubble, CSV I/W)
    csv_path: str = ""  # the schedule CSV's resolved path (schedule CSV_SCHEDULE)

    @property
    def v_shape(self) -> bool:
        return self.schedule != CSV_SCHEDULE and SCHEDULES[self.schedule].v_shape


def plan_pipeline(job_config: JobConfig) -> PipelinePlan:
    """Validates the pipeline options against each other and the batch; one clear line per mistake."""
    experimental, training = job_config.experimental, job_config.training
    pp = experimental.pipeline_parallel_degree
    csv_path = ""
    if experimental.pipeline_parallel_schedule_csv:
        csv_path = resolve_path(experimental.pipeline_parallel_schedule_csv, "experimental.pipeline_parallel_schedule_csv",
                                ConfigError)
        if not os.path.isfile(csv_path):
            raise ConfigError(f"experimental.pipeline_parallel_schedule_csv: no such file "
                              f"{experimental.pipeline_parallel_schedule_csv!r}")
        schedule = CSV_SCHEDULE
    else:
        schedule = _canonical(experimental.pipeline_parallel_schedule)
        if schedule is None:
            raise ConfigError(f"unknown experimental.pipeline_parallel_schedule {experimental.pipeline_parallel_schedule!r}; "
                              f"choose from {', '.join(SCHEDULES)} (or give pipeline_parallel_schedule_csv)")
    kind = SCHEDULES.get(schedule)
    stages_per_rank = experimental.pipeline_parallel_stages_per_rank
    if stages_per_rank == -1:
        # A CSV names its own stages; one per rank unless told otherwise.
        stages_per_rank = 2 if kind is not None and kind.multi_stage else 1
    elif stages_per_rank < 1:
        raise ConfigError(f"experimental.pipeline_parallel_stages_per_rank must be >= 1 or -1, got {stages_per_rank}")
    if kind is not None and not kind.multi_stage and stages_per_rank != 1:
        raise ConfigError(f"pipeline schedule {schedule} runs one stage per rank; set "
                          f"experimental.pipeline_parallel_stages_per_rank to 1 (or -1), not {stages_per_rank}, "
                          "or pick a multi-stage schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble)")
    if kind is not None and kind.v_shape and stages_per_rank != 2:
        raise ConfigError(f"pipeline schedule {schedule} places exactly 2 stages per rank (V shape); set "
                          f"experimental.pipeline_parallel_stages_per_rank to 2 (or -1), not {stages_per_rank}")
    num_stages = pp * stages_per_rank

    size, count = experimental.pipeline_parallel_microbatch_size, experimental.pipeline_parallel_microbatches
    if size != -1 and count != -1:
        raise ConfigError("set experimental.pipeline_parallel_microbatch_size or pipeline_parallel_microbatches, "
                          "not both")
    if size != -1:
        if size < 1 or training.batch_size % size:
            raise ConfigError(f"experimental.pipeline_parallel_microbatch_size {size} must divide training.batch_size "
                              f"{training.batch_size}")
        microbatches = training.batch_size // size
    else:
        microbatches = num_stages if count == -1 else count
        if microbatches < 1 or training.batch_size % microbatches:
            raise ConfigError(f"training.batch_size {training.batch_size} must split into "
                              f"experimental.pipeline_parallel_microbatches = {microbatches} equal microbatches")
    if kind is not None:
        needed = {"one": 1, "stages": num_stages, "pp": pp}[kind.min_microbatches]
        if microbatches < needed:
            # Fewer microbatches than a schedule's warm-up needs leaves ranks waiting on each other.
            raise ConfigError(f"pipeline schedule {schedule} needs at least {needed} microbatches for {pp} ranks x "
                              f"{stages_per_rank} stages, got {microbatches}; raise training.batch_size or "
                              "experimental.pipeline_parallel_microbatches")
        if kind.per_round and microbatches % pp:
            raise ConfigError(f"pipeline schedule {schedule} runs microbatches in rounds of the pipeline degree {pp}; "
                              f"{microbatches} microbatches is not a multiple of it")
    split_backward = _splits_backward(csv_path, kind)
    _check_backward_passes(job_config, schedule, split_backward)
    return PipelinePlan(schedule, pp, stages_per_rank, microbatches, split_backward, csv_path)


def plan_if_pipelined(config: JobConfig) -> PipelinePlan | None:
    """The shapes phase's rule (torchtitan/config/rules.py): the job's plan, made once per process
    and handed on; None without pipeline parallelism."""
    return plan_pipeline(config) if config.experimental.pipeline_parallel_degree > 1 else None


def _splits_backward(csv_path: str, kind: ScheduleKind | None) -> bool:
    """Whether the schedule runs the input and the weight gradients of a microbatch as two backward
    passes over the same graph: the zero-bubble family, and CSV schedules with I / W actions."""
    if kind is not None:
        return kind.split_backward
    try:
        with open(csv_path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"experimental.pipeline_parallel_schedule_csv {csv_path} is not a CSV text file (byte {e.start} "
                          "is not UTF-8)") from None
    except OSError as e:
        raise ConfigError(f"experimental.pipeline_parallel_schedule_csv {csv_path}: cannot read it: {e.strerror}") from None
    return re.search(r"\d+[IW]\d+", text) is not None


def _check_backward_passes(job_config: JobConfig, schedule: str, split_backward: bool) -> None:
    """Op-level selective activation checkpointing keeps each saved tensor for exactly one backward
    pass, so it cannot serve a schedule that splits backward in two."""
    ac = job_config.activation_checkpoint
    if split_backward and ac.mode == "selective" and ac.selective_ac_option == "op":
        raise ConfigError(f"activation_checkpoint.selective_ac_option 'op' cannot run under pipeline schedule {schedule}: "
                          "the schedule computes input and weight gradients in two backward passes, and op-level "
                          "checkpointing keeps its saved tensors for one; use activation_checkpoint.mode full, a block "
                          "option (selective_ac_option 2), or a schedule without split backward (1F1B, Interleaved1F1B)")


def stage_ids_for_rank(pp_rank: int, plan: PipelinePlan) -> list[int]:
    """The stages a rank runs: round-robin (rank r: r, r+pp, ...) or V-shaped (r and 2pp-1-r)."""
    if plan.v_shape:
        return [pp_rank, plan.num_stages - 1 - pp_rank]
    return [pp_rank + s * plan.pp for s in range(plan.stages_per_rank)]


def stage_ranks(plan: PipelinePlan) -> dict[int, int]:
    """The pp rank that runs each stage: the inverse of stage_ids_for_rank."""
    return {stage: rank for rank in range(plan.pp) for stage in stage_ids_for_rank(rank, plan)}


def balanced_split(costs: Sequence[float], num_stages: int) -> list[int]:
    """Cuts a sequence of per-unit costs into `num_stages` contiguous non-empty parts so that the
    most expensive part is as cheap as possible (exact, by dynamic programming). Returns the index
    where each part after the first starts."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ConfigError(f"cannot split {n} units into {num_stages} non-empty pipeline stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest possible maximum when the first i units form k parts.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return sorted(starts)[1:]
