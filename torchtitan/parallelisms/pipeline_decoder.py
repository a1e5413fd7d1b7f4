"""Pipeline parallelism for decoder models of the shared layout (`tok_embeddings`, `layers` keyed
by block index, `norm`, `output`, optional `vocab_mask`; a forward that skips missing parts): where
stages start, how a stage is cut out of the meta-device model, and how the stages become a
schedule. A family's pipelining function supplies its per-block costs and calls these.

A stage is a copy of the whole model with the blocks of other stages deleted and, except on the
first stage, no token embedding (the last stage alone keeps the final norm and output). Every
kept module keeps its original name (`layers.5.attention.wq.weight`), so checkpoints are the same
whatever the pipeline layout.
"""

from __future__ import annotations

import copy
import logging
from typing import Callable

import torch
from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.errors import ConfigError
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline import PipelinePlan, balanced_split, stage_ids_for_rank, stage_ranks
from torchtitan.parallelisms.pipeline_runtime import Pipeline, build_schedule, forward_only_schedule, make_stages
from torchtitan.parallelisms.pipeline_tied import TiedWeights

logger = logging.getLogger(__name__)


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


def decoder_unit_costs(block_flops: float | list[float], n_layers: int, vocab_rows: int, dim: int,
                       seq_len: int) -> list[float]:
    """Estimated training cost of each transformer block, in FLOPs per token: `block_flops` (the
    family's per-block cost, the one its FLOP count uses; one per block where blocks differ, as
    gpt-oss's banded and full ones) for every block, with the output
    projection added to the last block (it runs on the last stage) and the embedding lookup, which
    costs memory but almost no compute, counted by its parameters on the first."""
    costs = [float(c) for c in block_flops] if isinstance(block_flops, list) else [float(block_flops)] * n_layers
    costs[-1] += 6.0 * vocab_rows * dim
    costs[0] += vocab_rows * dim / seq_len  # the embedding's weight update, spread over the tokens
    return costs


def stage_starts(n_layers: int, unit_costs: list[float], job_config: JobConfig, plan: PipelinePlan) -> list[int]:
    """The block index where each stage after the first starts: as configured, or balancing
    `unit_costs` (one estimated cost per block)."""
    points = job_config.experimental.pipeline_parallel_split_points
    if points:
        starts = parse_split_points(points, n_layers)
        if len(starts) != plan.num_stages - 1:
            raise ConfigError(f"experimental.pipeline_parallel_split_points gives {len(starts) + 1} stages, but "
                              f"{plan.pp} ranks x {plan.stages_per_rank} stages per rank need {plan.num_stages}")
        return starts
    if plan.num_stages > n_layers:
        raise ConfigError(f"{plan.num_stages} pipeline stages need at least as many transformer blocks; the model has "
                          f"{n_layers}")
    return balanced_split(unit_costs, plan.num_stages)


def build_stage_module(model: nn.Module, first: int, last: int, num_stages: int, stage_id: int,
                       embedding_on_last_stage: bool = False) -> nn.Module:
    """A copy of the (meta-device) model that holds blocks first..last-1 under their original names.
    The last stage also keeps a model's `mtp` modules (multi-token prediction) and, with
    `embedding_on_last_stage` (they embed tokens ahead), a copy of the token embedding."""
    stage = copy.deepcopy(model)
    for name in list(stage.layers.keys()):
        if not first <= int(name) < last:
            del stage.layers[name]
    is_last = stage_id == num_stages - 1
    if stage_id != 0 and not (is_last and embedding_on_last_stage):
        stage.tok_embeddings = None
    if not is_last:
        stage.norm, stage.output, stage.vocab_mask = None, None, None
        if hasattr(stage, "mtp"):
            stage.mtp = None
    return stage


def build_decoder_pipeline(model: nn.Module, *, n_layers: int, starts: list[int], tied_embeddings: bool,
                           plan: PipelinePlan, parallel_dims: ParallelDims, job_config: JobConfig,
                           device: torch.device, parallelize_fn: Callable[..., nn.Module],
                           loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                           embedding_on_last_stage: bool = False) -> Pipeline:
    """Cuts this rank's stages at `starts`, parallelizes each with `parallelize_fn`, and builds
    the schedule around `loss_fn` (the TrainSpec's ParallelizeFn and LossFn; typed loosely here
    because parallelisms do not import the model registry). `embedding_on_last_stage`: the last
    stage keeps a copy of the token embedding, one weight with the first stage's (pipeline_tied.py),
    for a model whose last stage embeds tokens too (DeepSeek-V3's multi-token prediction)."""
    pp_mesh = parallel_dims.pp_mesh
    bounds = [0, *starts, n_layers]
    names = [f"layers.{bounds[i]}-{bounds[i + 1] - 1}" for i in range(plan.num_stages)]
    given = "given" if job_config.experimental.pipeline_parallel_split_points else "cost-balanced"
    logger.info(f"pipeline: {plan.num_stages} stages ({given} split at {', '.join(f'layers.{s}' for s in starts)}): "
                f"{'; '.join(names)}; schedule {plan.schedule}, {plan.microbatches} microbatches")
    stage_ids = stage_ids_for_rank(pp_mesh.get_local_rank(), plan)
    modules = []
    for stage_id in stage_ids:
        module = build_stage_module(model, bounds[stage_id], bounds[stage_id + 1], plan.num_stages, stage_id,
                                    embedding_on_last_stage)
        modules.append(parallelize_fn(module, parallel_dims, job_config))
    stages = make_stages(modules, stage_ids, plan, pp_mesh.get_group(), device)
    # The trainer's loss function is already weighted by each microbatch's share of the step's
    # valid tokens (trainer/loss_tokens.py), so that the gradients the schedule sums over
    # microbatches (it does not rescale them) are those of the mean over the whole step.
    microbatch_loss = loss_fn
    # Every rank passes the loss function: a schedule without one runs forward only.
    schedule = build_schedule(plan, stages, microbatch_loss)
    tied = None
    if tied_embeddings or embedding_on_last_stage:
        if tied_embeddings and embedding_on_last_stage:
            # A family's pipelining function asked for both: a bug in its code, not a user's setting.
            raise ValueError("a model whose last pipeline stage embeds tokens cannot also tie its output projection "
                             "to the embedding (one weight shared by three modules)")
        # The embedding (first stage) and the output projection, or the embedding's copy (last
        # stage), share one matrix.
        by_stage = dict(zip(stage_ids, modules))
        last_stage = plan.num_stages - 1
        placement = stage_ranks(plan)
        owners = (placement[0], placement[last_stage])
        tied = TiedWeights((by_stage[0], "tok_embeddings") if 0 in by_stage else None,
                           (by_stage[last_stage], "tok_embeddings" if embedding_on_last_stage else "output")
                           if last_stage in by_stage else None,
                           owners, parallel_dims.world_mesh)
    by_id = dict(zip(stage_ids, modules))

    def first_stage() -> nn.Module:
        # This rank's own, or a fresh one on the meta device (the dry run materialises it).
        if 0 in by_id:
            return by_id[0]
        return parallelize_fn(build_stage_module(model, bounds[0], bounds[1], plan.num_stages, 0,
                                                 embedding_on_last_stage), parallel_dims, job_config)

    return Pipeline(schedule, modules, 0 in stage_ids, plan.num_stages - 1 in stage_ids, tied,
                    make_eval_schedule=lambda: forward_only_schedule(plan, stages, microbatch_loss),
                    stage_ids=tuple(stage_ids), num_stages=plan.num_stages, microbatches=plan.microbatches,
                    microbatch_loss=microbatch_loss, first_stage=first_stage)
