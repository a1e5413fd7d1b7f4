"""Pipeline parallelism for gpt-oss: the shared decoder pipeline (torchtitan/parallelisms/
pipeline_decoder.py), cut where gpt-oss's block costs balance (a banded block's attention costs
less than a full one's at long sequences)."""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.models.gpt_oss.model import GptOssModelArgs, block_flops
from torchtitan.models.train_spec import LossFn, ParallelizeFn
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline import PipelinePlan
from torchtitan.parallelisms.pipeline_decoder import build_decoder_pipeline, decoder_unit_costs, stage_starts
from torchtitan.parallelisms.pipeline_runtime import Pipeline


def unit_costs(args: GptOssModelArgs, seq_len: int) -> list[float]:
    """Estimated training cost of each block (pipeline_decoder.decoder_unit_costs), banded blocks
    at their own cost."""
    per_block = [float(block_flops(args, i, seq_len)) for i in range(args.n_layers)]
    return decoder_unit_costs(per_block, args.n_layers, args.vocab_size + args.vocab_padding, args.dim, seq_len)


def stage_starts_for(args: GptOssModelArgs, job_config: JobConfig, plan: PipelinePlan) -> list[int]:
    return stage_starts(args.n_layers, unit_costs(args, job_config.training.seq_len), job_config, plan)


def pipeline_gpt_oss(model: nn.Module, *, model_args: GptOssModelArgs, plan: PipelinePlan,
                     parallel_dims: ParallelDims, job_config: JobConfig, device: torch.device,
                     parallelize_fn: ParallelizeFn, loss_fn: LossFn) -> Pipeline:
    """The TrainSpec's PipeliningFn: this rank's stages, each parallelized with `parallelize_fn`."""
    return build_decoder_pipeline(model, n_layers=model_args.n_layers,
                                  starts=stage_starts_for(model_args, job_config, plan), tied_embeddings=False,
                                  plan=plan, parallel_dims=parallel_dims, job_config=job_config, device=device,
                                  parallelize_fn=parallelize_fn, loss_fn=loss_fn)
