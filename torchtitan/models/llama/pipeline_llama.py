"""Pipeline parallelism for Llama: the shared decoder pipeline (torchtitan/parallelisms/
pipeline_decoder.py) cut where Llama's block costs (pipeline_split.py) balance."""

from __future__ import annotations

import torch

from torchtitan.config.job_config import JobConfig
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.models.llama.pipeline_split import split_points_for
from torchtitan.models.train_spec import LossFn, ParallelizeFn
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline import PipelinePlan
from torchtitan.parallelisms.pipeline_decoder import build_decoder_pipeline, build_stage_module  # noqa: F401
from torchtitan.parallelisms.pipeline_runtime import Pipeline


def pipeline_llama(model: Transformer, *, model_args: ModelArgs, plan: PipelinePlan, parallel_dims: ParallelDims,
                   job_config: JobConfig, device: torch.device, parallelize_fn: ParallelizeFn,
                   loss_fn: LossFn) -> Pipeline:
    """Splits `model` into this rank's stages (the TrainSpec's PipeliningFn), parallelizes each
    with `parallelize_fn`, and builds the schedule."""
    return build_decoder_pipeline(model, n_layers=model_args.n_layers, starts=split_points_for(model_args, job_config, plan),
                                  tied_embeddings=model_args.tie_word_embeddings, plan=plan,
                                  parallel_dims=parallel_dims, job_config=job_config, device=device,
                                  parallelize_fn=parallelize_fn, loss_fn=loss_fn)
