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

from torchtitan.config_manager import ConfigError, JobConfig
from torchtitan.models.llama.model import ModelArgs, Transformer, ffn_hidden_dim
from torchtitan.models.llama.parallelize_llama import parallelize_llama
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline import PipelinePlan, balanced_split, plan_pipeline, stage_ids_for_rank
from torchtitan.parallelisms.pipeline_runtime import build_schedule, make_stages
from torchtitan.parallelisms.pipeline_tied import TiedWeights

logger = logging.getLogger(__name__)


def unit_costs(args: ModelArgs, seq_len: int) -> list[float]:
    """Estimated training cost of each transformer block, in FLOPs per token (the matmuls of the
    block plus its attention scores), with the output projection added to the last block (it runs
    on the last stage) and the embedding lookup, which costs memory but almost no compute, counted
    by its parameters on the first."""
    head_dim = args.dim // args.n_heads
    kv_dim = (args.n_kv_heads or args.n_heads) * head_dim
    block_params = args.dim * (2 * args.dim + 2 * kv_dim) + 3 * args.dim * ffn_hidden_dim(args)
    block = 6.0 * block_params + 12.0 * args.n_heads * head_dim * seq_len
    vocab = args.vocab_size + args.vocab_padding
    costs = [block] * args.n_layers
    costs[-1] += 6.0 * vocab * args.dim
    costs[0] += vocab * args.dim / seq_len  # the embedding's weight update, spread over the tokens
    return costs


def parse_split_points(points: list[str], n_layers: int) -> list[int]:
    """`layers.N` names -> block indices where stages 2, 3, ... start, checked for order and range."""
    starts = []
    for point in points:
        prefix, _, index = point.partition(".")
        if prefix != "layers" or not index.isdecimal() or not 0 < int(index) < n_layers:
            raise ConfigError(f"experimental.pipeline_parallel_split_points: {point!r} is not a block where a stage "
                              f"can start; use layers.1 ... layers.{n_layers - 1}")
        starts.append(int(index))
    if starts != sorted(set(starts)):
        raise ConfigError(f"experimental.pipeline_parallel_split_points must be increasing and distinct, got {points}")
    return starts


def split_points_for(args: ModelArgs, job_config: JobConfig, plan: PipelinePlan) -> list[int]:
    """The block index where each stage after the first starts: as configured, or cost-balanced."""
    points = job_config.experimental.pipeline_parallel_split_points
    if points:
        starts = parse_split_points(points, args.n_layers)
        if len(starts) != plan.num_stages - 1:
            raise ConfigError(f"experimental.pipeline_parallel_split_points gives {len(starts) + 1} stages, but "
                              f"{plan.pp} ranks x {plan.stages_per_rank} stages per rank need {plan.num_stages}")
        return starts
    if plan.num_stages > args.n_layers:
        raise ConfigError(f"{plan.num_stages} pipeline stages need at least as many transformer blocks; the model has "
                          f"{args.n_layers}")
    return balanced_split(unit_costs(args, job_config.training.seq_len), plan.num_stages)


def validate_pipeline_llama(args: ModelArgs, job_config: JobConfig) -> None:
    """Pipeline checks that need the model's shape (run before any process group exists)."""
    split_points_for(args, job_config, plan_pipeline(job_config))


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


def pipeline_llama(model: Transformer, parallel_dims: ParallelDims, job_config: JobConfig, device: torch.device,
                   model_args: ModelArgs, loss_fn):
    """Splits `model` into this rank's stages, parallelizes each, and builds the schedule.

    Returns (schedule, model_parts, has_first_stage, has_last_stage, tied weights or None).
    """
    plan = plan_pipeline(job_config)
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
        modules.append(parallelize_llama(module, parallel_dims, job_config))
    stages = make_stages(modules, stage_ids, plan, pp_mesh.get_group(), device)
    accum = job_config.training.gradient_accumulation_steps
    scale = plan.microbatches * accum

    def microbatch_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # The mean over a microbatch, pre-divided so that the gradients summed over microbatches
        # and accumulation steps are those of the mean over the whole batch (the schedule does
        # not rescale them).
        return loss_fn(output, target) / scale

    # Every rank passes the loss function: a schedule without one runs forward only.
    schedule = build_schedule(plan, stages, microbatch_loss, job_config.experimental.pipeline_parallel_schedule_csv)
    tied = None
    if model_args.tie_word_embeddings:
        # The embedding (first stage) and the output projection (last stage) share one matrix.
        by_stage = dict(zip(stage_ids, modules))
        last_stage = plan.num_stages - 1
        owners = tuple(next(r for r in range(plan.pp) if s in stage_ids_for_rank(r, plan)) for s in (0, last_stage))
        tied = TiedWeights((by_stage[0], "tok_embeddings") if 0 in by_stage else None,
                           (by_stage[last_stage], "output") if last_stage in by_stage else None,
                           owners, parallel_dims.world_mesh)
    return schedule, modules, 0 in stage_ids, plan.num_stages - 1 in stage_ids, tied
