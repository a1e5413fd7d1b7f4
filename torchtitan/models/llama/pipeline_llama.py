"""Pipeline parallelism for Llama: cut the meta-device model into stages, parallelize each stage,
and hand them to a torch.distributed.pipelining schedule.

A stage is a copy of the whole `Transformer` with the blocks of other stages deleted and, except
on the first stage, no token embedding (the last stage alone keeps the final norm and output).
The model's forward already skips missing parts, and every kept module keeps its original name
(`layers.5.attention.wq.weight`), so checkpoints are the same whatever the pipeline layout.
"""

from __future__ import annotations

import copy
import logging

import torch

from torchtitan.job_config import JobConfig
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.models.llama.pipeline_split import split_points_for
from torchtitan.models.train_spec import LossFn, ParallelizeFn
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline import PipelinePlan, stage_ids_for_rank
from torchtitan.parallelisms.pipeline_runtime import Pipeline, build_schedule, make_stages
from torchtitan.parallelisms.pipeline_tied import TiedWeights

logger = logging.getLogger(__name__)


def build_stage_module(model: Transformer, first: int, last: int, num_stages: int, stage_id: int) -> Transformer:
    """A copy of the (meta-device) model that holds blocks first..last-1 under their original names."""
    stage = copy.deepcopy(model)
    for name in list(stage.layers.keys()):
        if not first <= int(name) < last:
            del stage.layers[name]
    if stage_id != 0:
        stage.tok_embeddings = None
    if stage_id != num_stages - 1:
        stage.norm, stage.output, stage.vocab_mask = None, None, None
    return stage


def pipeline_llama(model: Transformer, *, model_args: ModelArgs, plan: PipelinePlan, parallel_dims: ParallelDims,
                   job_config: JobConfig, device: torch.device, parallelize_fn: ParallelizeFn,
                   loss_fn: LossFn) -> Pipeline:
    """Splits `model` into this rank's stages (the TrainSpec's PipeliningFn), parallelizes each
    with `parallelize_fn`, and builds the schedule."""
    pp_mesh = parallel_dims.pp_mesh
    starts = split_points_for(model_args, job_config, plan)
    bounds = [0, *starts, model_args.n_layers]
    names = [f"layers.{bounds[i]}-{bounds[i + 1] - 1}" for i in range(plan.num_stages)]
    logger.info(f"pipeline: {plan.num_stages} stages ({'given' if job_config.experimental.pipeline_parallel_split_points else 'cost-balanced'} "
                f"split at {', '.join(f'layers.{s}' for s in starts)}): {'; '.join(names)}; schedule {plan.schedule}, "
                f"{plan.microbatches} microbatches")
    stage_ids = stage_ids_for_rank(pp_mesh.get_local_rank(), plan)
    modules = []
    for stage_id in stage_ids:
        module = build_stage_module(model, bounds[stage_id], bounds[stage_id + 1], plan.num_stages, stage_id)
        modules.append(parallelize_fn(module, parallel_dims, job_config))
    stages = make_stages(modules, stage_ids, plan, pp_mesh.get_group(), device)
    accum = job_config.training.gradient_accumulation_steps
    scale = plan.microbatches * accum

    def microbatch_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # The mean over a microbatch, pre-divided so that the gradients summed over microbatches
        # and accumulation steps are those of the mean over the whole batch (the schedule does
        # not rescale them).
        return loss_fn(output, target) / scale

    # Every rank passes the loss function: a schedule without one runs forward only.
    schedule = build_schedule(plan, stages, microbatch_loss)
    tied = None
    if model_args.tie_word_embeddings:
        # The embedding (first stage) and the output projection (last stage) share one matrix.
        by_stage = dict(zip(stage_ids, modules))
        last_stage = plan.num_stages - 1
        owners = tuple(next(r for r in range(plan.pp) if s in stage_ids_for_rank(r, plan)) for s in (0, last_stage))
        tied = TiedWeights((by_stage[0], "tok_embeddings") if 0 in by_stage else None,
                           (by_stage[last_stage], "output") if last_stage in by_stage else None,
                           owners, parallel_dims.world_mesh)
    return Pipeline(schedule, modules, 0 in stage_ids, plan.num_stages - 1 in stage_ids, tied)
