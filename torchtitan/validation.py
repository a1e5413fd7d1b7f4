"""Validation: the loss on held-out data, measured every `validation.freq` steps and at the last step.

Every run reads the same batches from the start of the validation data (the model's
`build_validation_dataloader_fn`: by default the training source's held-out split, which the
training loader skips, or `validation.dataset_path`), so runs of one job compare with each other
and nothing about validation needs to be checkpointed: training's data position, random state and
optimizer are untouched, and a resumed run trains exactly as an uninterrupted one.

It works under every layout the training step does: data-parallel ranks read different batches,
tensor/context/pipeline peers the same ones (context parallelism cuts each sequence as in
training; pipeline parallelism runs the schedule forward only), and the loss is the mean over
every token of every batch, as the training loss is.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtitan import watchdog
from torchtitan.datasets.shards import DataShards
from torchtitan.datasets.sources import DatasetError
from torchtitan.datasets.text_dataset import validation_batch_size
from torchtitan.job_config import JobConfig
from torchtitan.parallelisms import distributed as tt_dist
from torchtitan.parallelisms.context_parallel import shard_batch
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline_runtime import Pipeline


@dataclass(frozen=True)
class ValidationResult:
    step: int
    loss: float
    batches: int
    tokens: int  # over every data-parallel rank
    seconds: float

    @property
    def perplexity(self) -> float:
        # exp of a large loss overflows a float; an untrained model's loss is ~log(vocab) < 20.
        return math.exp(self.loss) if self.loss < 700 else math.inf


class Validator:
    def __init__(self, job_config: JobConfig, build_dataloader: Callable[..., Any], tokenizer: Any,
                 parallel_dims: ParallelDims, model_parts: list[nn.Module], loss_fn: Callable,
                 loss_context: Callable[[], contextlib.AbstractContextManager], pipeline: Pipeline | None,
                 device: torch.device, shards: DataShards):
        self.v, self.t = job_config.validation, job_config.training
        self.job_config, self.build_dataloader, self.tokenizer = job_config, build_dataloader, tokenizer
        self.parallel_dims, self.model_parts, self.loss_fn = parallel_dims, model_parts, loss_fn
        self.loss_context, self.pipeline, self.device = loss_context, pipeline, device
        # The validation data is cut into as many shards as the training data (training.dataset_shards),
        # so that, like a training batch, a validation batch depends only on the shard count and the
        # global batch size: every layout of a job validates on the same tokens.
        self.shards = shards
        self.batch_size = validation_batch_size(job_config)
        # Built once here, unread, so that a missing file or an unknown source name stops the run
        # at start-up rather than at the first validation, validation.freq steps later.
        self.build_dataloader(job_config, tokenizer, shards)

    def due(self, step: int) -> bool:
        return step % self.v.freq == 0 or step == self.t.steps

    def _loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss (on a pipeline's last stage; zero on its other stages)."""
        with self.loss_context():
            if self.pipeline is None:
                loss = self.loss_fn(self.model_parts[0](inputs), labels)
                return (loss.full_tensor() if isinstance(loss, DTensor) else loss).double()
            # The schedule's stages exchange microbatches shaped by training.batch_size: a larger
            # batch goes through in parts of that size (the config pass asks for a multiple).
            parts = [self.pipeline.evaluate(x, y, self.device, self.t.gradient_accumulation_steps)
                     for x, y in zip(inputs.split(self.t.batch_size), labels.split(self.t.batch_size))]
            return torch.stack(parts).double().mean()

    @torch.no_grad()
    def run(self, step: int) -> ValidationResult:
        start = time.perf_counter()
        batches = iter(self.build_dataloader(self.job_config, self.tokenizer, self.shards))
        counters = {m: m.count_step_stats for part in self.model_parts for m in part.modules()
                    if hasattr(m, "count_step_stats")}
        for part in self.model_parts:
            part.eval()
        for m in counters:  # routing statistics (MoE load balancing) count training tokens only
            m.count_step_stats = False
        total, n = torch.zeros((), device=self.device, dtype=torch.float64), 0
        try:
            while self.v.steps < 0 or n < self.v.steps:
                watchdog.enter("validation", step)
                batch = next(batches, None)
                if tt_dist.any_rank(batch is None):  # every rank stops after the same batch
                    break
                inputs, labels = (x.to(self.device, non_blocking=True) for x in batch)
                inputs, labels = shard_batch((inputs, labels), self.parallel_dims.cp_mesh)
                total += self._loss(inputs, labels)
                n += 1
        finally:
            for part in self.model_parts:
                part.train()
                # FSDP keeps the root's gathered parameters after a forward until its backward, which
                # a no-grad forward never has: the next training step would start from that state
                # instead of the usual sharded one (and compute slightly different gradients).
                for module in part.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()
            for m, counting in counters.items():
                m.count_step_stats = counting
        if n == 0:
            raise DatasetError(f"validation: the validation data gives no full batch of {self.batch_size} x "
                               f"{self.t.seq_len} tokens per data-parallel rank; give more validation data or lower "
                               "validation.batch_size")
        if self.pipeline is not None:  # only the last stage holds the loss; the others add zero
            total = tt_dist.sum_across(total, self.parallel_dims.pp_mesh)
        loss = tt_dist.mean_across(total / n, self.parallel_dims.loss_mesh)
        tokens = n * self.batch_size * self.t.seq_len * self.shards.dp_degree
        return ValidationResult(step, loss, n, tokens, time.perf_counter() - start)
