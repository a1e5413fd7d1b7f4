"""torch.distributed.pipelining internals: the runtime schedule (CSV and forward-only orders) and
what a schedule object keeps privately (its stages, its microbatch count, its loss call)."""

from __future__ import annotations

from typing import Any, Callable

from torch.distributed.pipelining import schedules

from torchtitan.runtime.torch_compat import CPU_AND_PRESENT_IN_2_11, PrivateName

_SCHEDULES = "torch.distributed.pipelining.schedules"
PRIVATE_NAMES = (
    PrivateName(f"{_SCHEDULES}._PipelineScheduleRuntime", ("stages", "n_microbatches", "loss_fn"),
                checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName(f"{_SCHEDULES}._PipelineScheduleRuntime._load_csv", ("self", "filename"), checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName(f"{_SCHEDULES}._Action", ("stage_index", "computation_type", "microbatch_index"),
                checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName(f"{_SCHEDULES}._ComputationType.FORWARD"),
    PrivateName(f"{_SCHEDULES}._add_unshard_reshard", ("compute_actions",), checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName(f"{_SCHEDULES}._add_send_recv", ("compute_actions", "stage_to_rank", "num_stages"),
                checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName(f"{_SCHEDULES}.PipelineScheduleMulti._stages", instance=True),
    PrivateName(f"{_SCHEDULES}.PipelineScheduleMulti._stages_forward_initialized", instance=True,
                checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName(f"{_SCHEDULES}.PipelineScheduleMulti._stages_backward_initialized", instance=True,
                checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName(f"{_SCHEDULES}.PipelineScheduleSingle._stage", instance=True),
    PrivateName(f"{_SCHEDULES}._PipelineSchedule._n_microbatches", instance=True, checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName(f"{_SCHEDULES}._PipelineSchedule._maybe_compute_loss", ("self", "stage", "output", "target_mbs", "mb_index"),
                checked=CPU_AND_PRESENT_IN_2_11),
)


def csv_schedule(stages: list, n_microbatches: int, loss_fn: Callable | None, csv_path: str) -> Any:
    """A schedule that runs the actions of a CSV file. The runtime schedule class that reads one
    has no public name (the public schedules are fixed orders)."""
    schedule = schedules._PipelineScheduleRuntime(stages, n_microbatches=n_microbatches, loss_fn=loss_fn,
                                                  scale_grads=False)
    schedule._load_csv(csv_path)
    return schedule


def is_csv_schedule(schedule: Any) -> bool:
    """Whether `schedule` is the runtime class `csv_schedule` makes."""
    return type(schedule) is schedules._PipelineScheduleRuntime


def forward_only_schedule(stages: list, n_microbatches: int, loss_fn: Callable,
                          order: dict[int, list[tuple[int, int]]], placement: dict[int, int],
                          num_stages: int) -> Any:
    """A runtime schedule running, on each pp rank, the forwards `order[rank]` lists as (stage,
    microbatch) pairs (`placement`: stage -> rank), lowered with FSDP's unshard/reshard around each stage's run and the sends
    and receives between ranks. There is no public forward-only schedule for any placement of
    stages, nor a public way to give the runtime schedule an order; the public lowering
    (`_prepare_schedule_with_comms`) wants every microbatch's backward too.

    The stages were set up by the training schedule's first step (validation comes after it).
    Setting them up again for forward only would give their receive buffers no gradients, which
    the training schedule, unaware of it, would then run its backward through; so they are marked
    set up here."""
    schedule = schedules._PipelineScheduleRuntime(stages, n_microbatches=n_microbatches, loss_fn=loss_fn,
                                                  scale_grads=False)
    forward = schedules._ComputationType.FORWARD
    actions = {rank: [schedules._Action(stage, forward, mb) for stage, mb in pairs] for rank, pairs in order.items()}
    schedule.stage_index_to_group_rank = placement
    for stage in stages:
        stage.stage_index_to_group_rank = placement
    schedule.pipeline_order = actions
    lowered = {rank: schedules._add_unshard_reshard(rank_actions) for rank, rank_actions in actions.items()}
    schedule.pipeline_order_with_comms = schedules._add_send_recv(lowered, stage_to_rank=placement.__getitem__,
                                                                  num_stages=num_stages)
    for flag, value in (("_stages_initialized", True), ("_stages_forward_initialized", True),
                        ("_stages_backward_initialized", False)):
        if hasattr(schedule, flag):  # the names differ between PyTorch versions
            setattr(schedule, flag, value)
    return schedule


def schedule_stages(schedule: Any) -> list:
    """This rank's stage objects: single-stage schedules keep theirs in `_stage`, multi-stage
    ones in `_stages`; neither has a public getter."""
    return getattr(schedule, "_stages", None) or [schedule._stage]


def schedule_microbatches(schedule: Any) -> int:
    """The microbatch count a schedule was built with (no public getter)."""
    return schedule._n_microbatches


def wrap_loss_computation(schedule: Any, wrap: Callable[[Callable], Callable]) -> None:
    """Replaces the schedule's loss call (`_maybe_compute_loss`, the only place it computes the
    loss) by `wrap(call)`, where the schedule has one; the public API offers no hook there."""
    if hasattr(schedule, "_maybe_compute_loss"):
        schedule._maybe_compute_loss = wrap(schedule._maybe_compute_loss)
