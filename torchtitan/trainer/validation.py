"""Validation: the loss on held-out data, measured every `validation.freq` steps and at the last step.

Every run reads the same batches from the start of the validation data (the model's
`build_validation_dataloader_fn`: by default the training source's held-out split, which the
training loader skips, or `validation.dataset_path`), so runs of one job compare with each other
and nothing about validation needs to be checkpointed: training's data position, random state and
optimizer are untouched, and a resumed run trains exactly as an uninterrupted one.

It works under every layout the training step does: data-parallel ranks read different batches,
tensor/context/pipeline peers the same ones (context parallelism cuts each sequence as in
training; pipeline parallelism runs the schedule forward only), and the loss is the mean over
every token that carries a loss (label not ignored) of every batch, as the training loss is.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtitan.config.job_config import JobConfig
from torchtitan.datasets.shards import DataShards
from torchtitan.datasets.sources import DatasetError
from torchtitan.datasets.text_dataset import validation_batch_size
from torchtitan.observability.watchdog import Watchdog
from torchtitan.parallelisms.chunked_loss import loss_from_forward
from torchtitan.parallelisms.context_parallel import shard_batch
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline_runtime import Pipeline
from torchtitan.runtime import collectives
from torchtitan.trainer.loss_tokens import TokenWeightedLoss, valid_count
from torchtitan.trainer.step import batch_documents, document_mask_eos, model_kwargs

logger = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class ValidatedModel:
    """What validation runs forward: this rank's model parts (its pipeline stages, with PP), their
    pipeline and device, and the loss with the context it runs in (loss parallelism, or none)."""

    parallel_dims: ParallelDims
    parts: list[nn.Module]
    pipeline: Pipeline | None
    device: torch.device
    loss_fn: Callable
    loss_context: Callable[[], contextlib.AbstractContextManager]


class Validator:
    def __init__(self, job_config: JobConfig, build_dataloader: Callable[..., Any], tokenizer: Any,
                 model: ValidatedModel, shards: DataShards):
        self.validation, self.training = job_config.validation, job_config.training
        self.job_config, self.build_dataloader, self.tokenizer = job_config, build_dataloader, tokenizer
        self.parallel_dims, self.model_parts = model.parallel_dims, model.parts
        # Summed over valid tokens, then divided by their count over every batch and rank.
        self.loss_fn = model.loss_fn if isinstance(model.loss_fn, TokenWeightedLoss) else TokenWeightedLoss(model.loss_fn, None)
        self.loss_context, self.pipeline, self.device = model.loss_context, model.pipeline, model.device
        # The validation data is cut into as many shards as the training data (training.dataset_shards),
        # so that, like a training batch, a validation batch depends only on the shard count and the
        # global batch size: every layout of a job validates on the same tokens.
        self.shards = shards
        self.batch_size = validation_batch_size(job_config)
        self.eos_id = document_mask_eos(job_config, tokenizer)  # validation masks documents as training does
        # Its first batch is read here, so that a missing or empty file, an unknown source, a
        # missing package or a split too small stops the run at start-up rather than at the first
        # validation, validation.freq steps later.
        if next(iter(self.build_dataloader(job_config, tokenizer, shards)), None) is None:
            raise DatasetError(self._too_small())

    def _too_small(self) -> str:
        return (f"validation: the validation data gives no full batch of {self.batch_size} x {self.training.seq_len} tokens "
                "per data-parallel rank; give more validation data or lower validation.batch_size")

    def due(self, step: int) -> bool:
        return step % self.validation.freq == 0 or step == self.training.steps

    def _loss(self, inputs: torch.Tensor, labels: torch.Tensor, ids_from: torch.Tensor,
              documents: torch.Tensor | None) -> torch.Tensor:
        """The batch's loss summed over its valid tokens (on a pipeline's last stage; zero on its
        other stages).

        A batch larger than training.batch_size goes through in parts of that size: a job that
        accumulates gradients because one optimizer step's rows do not fit at once (the default
        validation batch) must not run them at once here. Under pipeline parallelism the stages
        exchange microbatches shaped by training.batch_size anyway (the config pass asks for a
        multiple). `ids_from`: the tokens the document ids are counted from (the whole sequences);
        `documents`: the batch's own document ids where the data gives them."""
        parts = []
        size = self.training.batch_size
        document_parts = documents.split(size) if documents is not None else [None] * len(ids_from.split(size))
        with self.loss_context(), self.loss_fn.summing():
            for x, y, whole, docs in zip(inputs.split(size), labels.split(size), ids_from.split(size), document_parts):
                extra = model_kwargs(whole, self.eos_id, docs)
                if self.loss_fn.loss_fn is loss_from_forward:  # training.loss_chunk_size: the forward computes it
                    extra["labels"] = y
                if self.pipeline is not None:
                    parts.append(self.pipeline.evaluate(x, y, self.device, **extra))
                    continue
                loss = self.loss_fn(self.model_parts[0](x, **extra), y)
                parts.append(loss.full_tensor() if isinstance(loss, DTensor) else loss)
        return torch.stack(parts).double().sum()

    @torch.no_grad()
    def run(self, step: int, stops: Any = None, watchdog: Watchdog | None = None) -> ValidationResult | None:
        """Validates the model as it is after `step`; None when a stop (a signal, a preemption) was
        requested on some rank meanwhile: the validation is abandoned at the next batch, so that the
        training loop can stop and save without waiting for it. `watchdog`: this rank's, told of each
        batch (a rank stuck in validation is named like one stuck in a step)."""
        start = time.perf_counter()
        batches = iter(self.build_dataloader(self.job_config, self.tokenizer, self.shards))
        counters = {m: m.count_step_stats for part in self.model_parts for m in part.modules()
                    if hasattr(m, "count_step_stats")}
        for part in self.model_parts:
            part.eval()
        for m in counters:  # routing statistics (MoE load balancing) count training tokens only
            m.count_step_stats = False
        # The summed loss and the count of valid tokens (labels that carry a loss).
        total, count, n = torch.zeros((), device=self.device, dtype=torch.float64), 0, 0
        try:
            while self.validation.steps < 0 or n < self.validation.steps:
                if watchdog is not None:
                    watchdog.enter("validation", step)
                batch = next(batches, None)
                # Every rank stops after the same batch: at the end of the data, or for a stop.
                ended, stop = collectives.max_across_ranks([batch is None, stops.requested if stops is not None else 0])
                if stop:
                    logger.info(f"validation at step {step} abandoned after {n} batch{'' if n == 1 else 'es'}: a stop was requested")
                    return None
                if ended:
                    break
                inputs, labels = (x.to(self.device, non_blocking=True) for x in batch[:2])
                # Document ids from the whole sequences (the host's under CP, as forward_backward's).
                on_host = self.parallel_dims.cp_mesh is not None
                ids_from = batch[0] if on_host else inputs
                documents = batch_documents(batch, self.device, on_host)
                inputs, labels = shard_batch((inputs, labels), self.parallel_dims.cp_mesh)
                total += self._loss(inputs, labels, ids_from, documents)
                count += valid_count(labels)
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
        return self._result(step, total, count, n, start)

    def _result(self, step: int, total: torch.Tensor, count: Any, n: int, start: float) -> ValidationResult:
        """The loss summed over every rank's `n` batches, divided by their valid tokens' `count`."""
        if n == 0:
            raise DatasetError(self._too_small())
        if self.pipeline is not None:  # only the last stage holds the loss; the others add zero
            total = collectives.sum_across(total, self.parallel_dims.pp_mesh)
        summed, tokens_with_loss = collectives.sum_across(torch.stack([total, count.double()]),
                                                          self.parallel_dims.loss_mesh).tolist()
        loss = summed / tokens_with_loss if tokens_with_loss else math.nan
        tokens = n * self.batch_size * self.training.seq_len * self.shards.dp_degree
        return ValidationResult(step, loss, n, tokens, time.perf_counter() - start)
