"""Pipeline parallelism for DeepSeek-V3: the shared decoder pipeline (torchtitan/parallelisms/
pipeline_decoder.py), cut where the block costs balance (dense first blocks cost less than MoE
ones). The last stage holds the MTP modules and, for them, a copy of the token embedding that
stays one weight with the first stage's."""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.models.deepseek_v3.model import DeepSeekV3ModelArgs, block_flops, flops_per_token
from torchtitan.models.train_spec import LossFn, ParallelizeFn
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline import PipelinePlan
from torchtitan.parallelisms.pipeline_decoder import build_decoder_pipeline, stage_starts
from torchtitan.parallelisms.pipeline_runtime import Pipeline


def unit_costs(args: DeepSeekV3ModelArgs, seq_len: int) -> list[float]:
    """Estimated training FLOPs per token of each block; the last carries the output projection
    and the MTP modules (everything after the blocks), the first the embedding's update."""
    costs = [float(block_flops(args, i, seq_len)) for i in range(args.n_layers)]
    costs[-1] += flops_per_token(args, seq_len) - sum(costs)
    rows = args.vocab_size + args.vocab_padding
    costs[0] += rows * args.dim / seq_len
    return costs


def stage_starts_for(args: DeepSeekV3ModelArgs, job_config: JobConfig, plan: PipelinePlan) -> list[int]:
    return stage_starts(args.n_layers, unit_costs(args, job_config.training.seq_len), job_config, plan)


def pipeline_deepseek_v3(model: nn.Module, *, model_args: DeepSeekV3ModelArgs, plan: PipelinePlan,
                         parallel_dims: ParallelDims, job_config: JobConfig, device: torch.device,
                         parallelize_fn: ParallelizeFn, loss_fn: LossFn) -> Pipeline:
    """The TrainSpec's PipeliningFn: this rank's stages, each parallelized with `parallelize_fn`."""
    return build_decoder_pipeline(model, n_layers=model_args.n_layers,
                                  starts=stage_starts_for(model_args, job_config, plan), tied_embeddings=False,
                                  plan=plan, parallel_dims=parallel_dims, job_config=job_config, device=device,
                                  parallelize_fn=parallelize_fn, loss_fn=loss_fn,
                                  embedding_on_last_stage=model_args.mtp_depth > 0)
