"""Pipeline parallelism at run time: stages, the schedule, and the step that drives it."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor import DTensor

from torchtitan.errors import ConfigError
from torchtitan.parallelisms.pipeline import CSV_SCHEDULE, SCHEDULES, PipelinePlan, stage_ids_for_rank, stage_ranks
from torchtitan.parallelisms.pipeline_tied import TiedWeights
from torchtitan.runtime import collectives
from torchtitan.runtime.torch_compat import compile as torch_compat_compile
from torchtitan.runtime.torch_compat import pipelining as torch_compat_pipelining


def build_schedule(plan: PipelinePlan, stages: list, loss_fn: Callable | None):
    """The torch.distributed.pipelining schedule for this rank's stages.

    Gradients are not rescaled by the schedule (scale_grads=False): the loss function passed in
    already divides by the number of microbatches (and accumulation steps), so gradients that
    accumulate over several `step()` calls are never divided twice.
    """
    if plan.split_backward:
        # Zero-bubble schedules run each microbatch's backward as two passes over one graph (input
        # gradients with retain_graph, then weight gradients); compiled blocks must then keep the
        # buffers they would otherwise donate to the first pass. Compilation is lazy, so this is in time.
        torch_compat_compile.keep_donated_buffers()
    if plan.schedule == CSV_SCHEDULE:
        return torch_compat_pipelining.csv_schedule(stages, plan.microbatches, loss_fn, plan.csv_path)
    try:
        cls = schedules.get_schedule_class(plan.schedule)
    except ValueError:
        raise ConfigError(f"pipeline schedule {plan.schedule} is not in the installed PyTorch "
                          f"{torch.__version__}; pick another experimental.pipeline_parallel_schedule") from None
    target = stages if SCHEDULES[plan.schedule].multi_stage else stages[0]
    return cls(target, n_microbatches=plan.microbatches, loss_fn=loss_fn, scale_grads=False)


def forward_only_schedule(plan: PipelinePlan, stages: list, loss_fn: Callable):
    """A schedule that runs forwards only (validation), for any placement of stages: each rank runs
    its stages in stage order, every microbatch of one stage before the next (GPipe's order), so a
    rank never waits for work that itself waits on this rank. The training schedules' own `eval`
    cannot serve: the V-shaped and CSV ones run their backward actions regardless."""
    order = {rank: [(stage, mb) for stage in stage_ids_for_rank(rank, plan) for mb in range(plan.microbatches)]
             for rank in range(plan.pp)}
    return torch_compat_pipelining.forward_only_schedule(stages, plan.microbatches, loss_fn, order, stage_ranks(plan),
                                                         plan.num_stages)


def make_stages(modules: list[nn.Module], stage_ids: list[int], plan: PipelinePlan, group, device: torch.device):
    return [PipelineStage(module, stage_id, plan.num_stages, device, group=group)
            for module, stage_id in zip(modules, stage_ids)]


class BusyTimer:
    """Measures how much of a schedule's step this rank spends computing (its stages' forward and
    backward chunks and the loss); the rest of the step is the pipeline bubble plus waiting for
    neighbours. Wraps the methods of this rank's stage objects, so it works for every schedule,
    including CSV ones, and costs two clock reads per chunk."""

    _STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, schedule) -> None:
        self.busy = 0.0
        for stage in torch_compat_pipelining.schedule_stages(schedule):
            for name in self._STAGE_METHODS:
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name)))
        torch_compat_pipelining.wrap_loss_computation(schedule, self._timed)

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - start

        return wrapper


def _count_statistics_in_chunks_only(schedule, counting_on: Callable[[], bool]) -> None:
    """Modules that keep per-step statistics (a `count_step_stats` flag, e.g. MoE routed-token
    counts) count only in the schedule's microbatch forwards of training steps (`counting_on()`):
    on its first step a schedule also runs each stage forward once to learn the shapes it
    exchanges, and validation runs forwards too; neither must count."""
    for stage in torch_compat_pipelining.schedule_stages(schedule):
        counters = [m for m in stage.submod.modules() if hasattr(m, "count_step_stats")]
        if not counters:
            continue
        for m in counters:
            m.count_step_stats = False

        def counting(fn, counters=counters):
            def wrapper(*args, **kwargs):
                for m in counters:
                    m.count_step_stats = counting_on()
                try:
                    return fn(*args, **kwargs)
                finally:
                    for m in counters:
                        m.count_step_stats = False

            return wrapper

        stage.forward_one_chunk = counting(stage.forward_one_chunk)


@dataclasses.dataclass
class Pipeline:
    """What a model's pipelining_fn returns: the schedule and this rank's stages (and, for a model
    whose first and last stage share a weight, the TiedWeights that keep its copies one weight)."""

    schedule: Any
    model_parts: list[nn.Module]
    has_first_stage: bool
    has_last_stage: bool
    tied: TiedWeights | None = None
    # Builds the forward-only schedule validation runs (forward_only_schedule); None: no validation.
    make_eval_schedule: Callable[[], Any] | None = None
    # What the dry run needs to replay this rank's share of a step without the schedule's
    # communication (estimation/pipeline_replay.py); a pipeline without them is not replayed.
    stage_ids: tuple[int, ...] = ()  # of model_parts, in order
    num_stages: int = 0
    microbatches: int = 0
    microbatch_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # scaled as the schedule's
    # The first stage's module (this rank's own, or one built on the meta device for the purpose):
    # its output is what every stage hands the next, whose shape the dry run's replay needs.
    first_stage: Callable[[], nn.Module] | None = None

    def __post_init__(self) -> None:
        self.timer = BusyTimer(self.schedule)
        self.step_seconds = 0.0
        self._evaluating = False
        self._eval_schedule = None
        _count_statistics_in_chunks_only(self.schedule, lambda: not self._evaluating)

    def bubble_since_last_call(self, pp_mesh) -> float:
        """The pp ranks' mean share of schedule time spent not computing, since the last call."""
        idle = torch.tensor(1 - self.timer.busy / self.step_seconds if self.step_seconds else 0.0, dtype=torch.float64)
        self.timer.busy, self.step_seconds = 0.0, 0.0
        return collectives.mean_across(idle, pp_mesh)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, device: torch.device, /,
                         **kwargs: torch.Tensor) -> torch.Tensor:
        """Runs one batch through the schedule (microbatched forwards and backwards). Returns the
        batch's loss on the last stage (the schedule's loss function is already scaled) and zero
        elsewhere. `kwargs` (document_ids; labels for a model that takes them) go to every stage's
        forward: every rank passes them, and the schedule cuts them into microbatches along the
        batch as it cuts the inputs."""
        targets, losses = (labels, []) if self.has_last_stage else (None, None)
        args = (inputs,) if self.has_first_stage else ()
        start = time.perf_counter()
        self.schedule.step(*args, target=targets, losses=losses, return_outputs=False, **kwargs)
        self.step_seconds += time.perf_counter() - start
        if not self.has_last_stage:
            return torch.zeros((), device=device)
        return torch.stack([loss.full_tensor() if isinstance(loss, DTensor) else loss for loss in losses]).sum()

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, device: torch.device, /,
                 **kwargs: torch.Tensor) -> torch.Tensor:
        """Runs one batch forward only (the schedule's `eval`, microbatched like a training step)
        and returns the sum of its microbatches' losses on the last stage, zero elsewhere (the
        validator runs it with the loss function summing: the batch's summed loss); `kwargs` as
        in `forward_backward`."""
        if self.make_eval_schedule is None:
            raise NotImplementedError("this pipeline was built without a forward-only schedule (make_eval_schedule)")
        if self._eval_schedule is None:
            self._eval_schedule = self.make_eval_schedule()
        targets, losses = (labels, []) if self.has_last_stage else (None, None)
        args = (inputs,) if self.has_first_stage else ()
        self._evaluating, busy = True, self.timer.busy  # validation is no part of the bubble figures
        try:
            self._eval_schedule.eval(*args, target=targets, losses=losses, return_outputs=False, **kwargs)
        finally:
            self._evaluating, self.timer.busy = False, busy
        if not self.has_last_stage:
            return torch.zeros((), device=device)
        return torch.stack([loss.full_tensor() if isinstance(loss, DTensor) else loss for loss in losses]).sum()
