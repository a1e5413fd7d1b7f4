"""Pipeline parallelism for Qwen3: the shared decoder pipeline (torchtitan/parallelisms/
pipeline_decoder.py), cut where Qwen3's block costs balance."""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.job_config import JobConfig
from torchtitan.models.qwen3.model import Qwen3ModelArgs, param_counts
from torchtitan.models.train_spec import LossFn, ParallelizeFn
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline import PipelinePlan
from torchtitan.parallelisms.pipeline_decoder import build_decoder_pipeline, stage_starts
from torchtitan.parallelisms.pipeline_runtime import Pipeline


def unit_costs(args: Qwen3ModelArgs, seq_len: int) -> list[float]:
    """Training FLOPs per token of each block (its activated parameters and attention scores),
    with the output projection on the last block and the embedding's update on the first."""
    _, active = param_counts(args)
    rows = args.vocab_size + args.vocab_padding
    embeddings = rows * args.dim * (1 if args.tie_word_embeddings else 2)
    block = 6.0 * (active - embeddings - args.dim) / args.n_layers + 12.0 * args.n_heads * args.head_dim * seq_len
    costs = [block] * args.n_layers
    costs[-1] += 6.0 * rows * args.dim
    costs[0] += rows * args.dim / seq_len
    return costs


def stage_starts_for(args: Qwen3ModelArgs, job_config: JobConfig, plan: PipelinePlan) -> list[int]:
    return stage_starts(args.n_layers, unit_costs(args, job_config.training.seq_len), job_config, plan)


def pipeline_qwen3(model: nn.Module, *, model_args: Qwen3ModelArgs, plan: PipelinePlan, parallel_dims: ParallelDims,
                   job_config: JobConfig, device: torch.device, parallelize_fn: ParallelizeFn,
                   loss_fn: LossFn) -> Pipeline:
    """The TrainSpec's PipeliningFn: this rank's stages, each parallelized with `parallelize_fn`."""
    return build_decoder_pipeline(model, n_layers=model_args.n_layers, starts=stage_starts_for(model_args, job_config, plan),
                                  tied_embeddings=model_args.tie_word_embeddings, plan=plan,
                                  parallel_dims=parallel_dims, job_config=job_config, device=device,
                                  parallelize_fn=parallelize_fn, loss_fn=loss_fn)
