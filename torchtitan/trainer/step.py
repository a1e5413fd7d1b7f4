"""The parts of a training step that the trainer (trainer/loop.py) and the dry run
(estimation/dry_run.py) share: the model parts built for this rank, one optimizer step's forwards
and backwards, and the context the loss is computed in (validation uses it too)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import Any, Callable, ContextManager

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.config.job_config import JobConfig
from torchtitan.models import TrainSpec
from torchtitan.models.common import document_ids
from torchtitan.parallelisms.chunked_loss import install_chunked_loss, loss_from_forward
from torchtitan.parallelisms.context_parallel import shard_batch
from torchtitan.parallelisms.lora import init_adapters
from torchtitan.parallelisms.mixed_precision import apply_mixed_precision
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline import PipelinePlan
from torchtitan.parallelisms.pipeline_runtime import Pipeline
from torchtitan.trainer.loss_tokens import TokenWeightedLoss


def build_model_parts(job_config: JobConfig, train_spec: TrainSpec, parallel_dims: ParallelDims,
                      plan: PipelinePlan | None, model: torch.nn.Module, model_args: Any,
                      device: torch.device) -> tuple[list[torch.nn.Module], Pipeline | None]:
    """The meta-device model parallelized (cut into this rank's pipeline stages first, with PP) and
    materialised on `device`: this rank's model parts, and the pipeline that runs them."""
    model_parts, pipeline = parallelize_model(job_config, train_spec, parallel_dims, plan, model, model_args, device)
    materialize(job_config, model_parts, device)
    if pipeline is not None and pipeline.tied is not None:
        pipeline.tied.sync_values()  # the last stage's copy of a tied weight starts as the first's
    return model_parts, pipeline


def with_compiled_loss(train_spec: TrainSpec, job_config: JobConfig, parallel_dims: ParallelDims,
                       device_type: str) -> TrainSpec:
    """The train spec whose loss is compiled under training.compile on CUDA. Compiled, the upcast
    of the logits, the log-softmax and the pick of the labels' entries fuse into a few kernels, and
    backward recomputes the probabilities from the logits: neither the fp32 logits nor their
    log-probabilities are stored whole (with Llama 3's 128K vocabulary at seq 8192, 4 GiB each).
    On CPU it is left eager: there it saved 22 ms of a 4.6 s step (debug model) and cost about 6 s
    of compilation per run, which short CPU runs never earn back. Under loss parallelism the loss
    stays eager too: DTensor's loss_parallel context dispatches its vocabulary-sharded cross-entropy."""
    if (not job_config.training.compile or parallel_dims.loss_parallel_enabled or device_type != "cuda"
            or train_spec.loss_fn is loss_from_forward):  # chunked: the model's forward computes it
        return train_spec
    return dataclasses.replace(train_spec, loss_fn=torch.compile(train_spec.loss_fn))


def with_chunked_loss(train_spec: TrainSpec, job_config: JobConfig) -> TrainSpec:
    """The train spec under training.loss_chunk_size (parallelisms/chunked_loss.py): each model
    part gets a ChunkedLossHead as its output before the family's own parallelize function runs
    (TP lays it out, FSDP wraps it in the root unit), its forward takes the labels and returns
    the loss, and the loss function passes that through. Unchanged when the option is 0."""
    if not job_config.training.loss_chunk_size:
        return train_spec
    return dataclasses.replace(train_spec, loss_fn=loss_from_forward,
                               parallelize_fn=functools.partial(_parallelize_with_chunked_loss, train_spec.parallelize_fn))


def _parallelize_with_chunked_loss(parallelize_fn: Callable[..., torch.nn.Module], model: torch.nn.Module,
                                   parallel_dims: ParallelDims, job_config: JobConfig) -> torch.nn.Module:
    install_chunked_loss(model, job_config.training.loss_chunk_size)
    return parallelize_fn(model, parallel_dims, job_config)


def with_training_loss(train_spec: TrainSpec, job_config: JobConfig, parallel_dims: ParallelDims,
                       device_type: str) -> TrainSpec:
    """The train spec's loss as a training step computes it: inside the output head under
    training.loss_chunk_size (`with_chunked_loss`), else compiled on CUDA (`with_compiled_loss`);
    either way weighted by its micro-batch's share of the step's valid tokens (`with_token_weights`)."""
    return with_token_weights(with_compiled_loss(with_chunked_loss(train_spec, job_config), job_config, parallel_dims,
                                                 device_type), parallel_dims)


def with_token_weights(train_spec: TrainSpec, parallel_dims: ParallelDims) -> TrainSpec:
    """The train spec whose loss is a TokenWeightedLoss (trainer/loss_tokens.py): the step's loss
    is the mean over its valid tokens across micro-batches and the loss mesh's ranks."""
    return dataclasses.replace(train_spec, loss_fn=TokenWeightedLoss(train_spec.loss_fn, parallel_dims))


def parallelize_model(job_config: JobConfig, train_spec: TrainSpec, parallel_dims: ParallelDims,
                      plan: PipelinePlan | None, model: torch.nn.Module, model_args: Any,
                      device: torch.device) -> tuple[list[torch.nn.Module], Pipeline | None]:
    """This rank's model parts, still on the meta device, parallelized, and their pipeline."""
    pipeline = None
    if parallel_dims.pp_enabled:
        # Each rank keeps only its stages, each parallelized like a whole model would be.
        pipeline = train_spec.pipelining_fn(model, model_args=model_args, plan=plan, parallel_dims=parallel_dims,
                                            job_config=job_config, device=device,
                                            parallelize_fn=train_spec.parallelize_fn, loss_fn=train_spec.loss_fn)
        model_parts = pipeline.model_parts
    else:
        model_parts = [train_spec.parallelize_fn(model, parallel_dims, job_config)]
    # After any model's parallelize function: FSDP's policy or autocast, the same rule for all families.
    apply_mixed_precision(model_parts, parallel_dims, job_config.training, device.type)
    return model_parts, pipeline


def materialize(job_config: JobConfig, model_parts: list[torch.nn.Module], device: torch.device) -> None:
    """Gives meta-device parts their storage on `device` and their initial values."""
    for part in model_parts:
        # With CPU offload FSDP keeps the sharded parameters in host memory; buffers stay on the device.
        part.to_empty(device="cpu" if job_config.training.enable_cpu_offload else device)
        with torch.no_grad():
            part.init_weights(buffer_device=device)
        init_adapters(part, max(job_config.training.seed, 0))  # LoRA's, alike under every layout
        part.train()


def _skip_reductions(parallel_dims: ParallelDims, model_parts: list[torch.nn.Module], last: bool,
                     defer_sharded: bool) -> None:
    """Which gradient reductions a micro-step of gradient accumulation runs. Unsharded data
    parallelism (DDP, or replication beside TP/PP) keeps whole gradients anyway: it reduces on the
    last micro-step only. FSDP reduce-scatters every micro-step into the gradient shards, since
    skipping it would keep a whole unsharded copy of the gradients across micro-steps (a 70B model
    over TP 4 holds 33 GiB of them), unless `defer_sharded` asks for exactly that; HSDP's all-reduce
    across replicas runs on the last micro-step only (FSDP keeps the partial sums until then)."""
    if not parallel_dims.wraps_data_parallel:
        return
    sharded = parallel_dims.fsdp_enabled
    for part in model_parts:
        if not sharded or defer_sharded:
            part.set_requires_gradient_sync(last)
        elif parallel_dims.dp_replicate_enabled:
            part.set_requires_all_reduce(last)


def document_mask_eos(job_config: JobConfig, tokenizer: Any) -> int | None:
    """The end-of-text id that separates documents under training.document_mask; None when the
    option is off (the preflight refused it for a tokenizer without one)."""
    return tokenizer.eos_id if job_config.training.document_mask else None


def model_kwargs(inputs: torch.Tensor, eos_id: int | None,
                 documents: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The model's keyword inputs beside the tokens: the document ids of the whole sequences, which
    every pipeline stage and tensor-parallel rank gets alike: the batch's own where the data gives
    them (`documents`: packed conversations, sft.py, always kept apart), else with document masking
    (`eos_id` given) counted from the end-of-text tokens; none otherwise, so the forward is exactly
    today's. Under
    context parallelism the callers pass the host's tensors: CP attention plans its blocks from the
    host's ids, without waiting for the device (parallelisms/cp_attention.py)."""
    if documents is not None:
        return {"document_ids": documents}
    return {} if eos_id is None else {"document_ids": document_ids(inputs, eos_id)}


def batch_documents(batch: tuple[torch.Tensor, ...], device: torch.device, on_host: bool) -> torch.Tensor | None:
    """A batch's own document ids (its third tensor, where the data gives one), on the host under
    context parallelism (see model_kwargs), else on `device`."""
    if len(batch) < 3:
        return None
    return batch[2] if on_host else batch[2].to(device, non_blocking=True)


def takes_labels(train_spec: TrainSpec) -> bool:
    """Whether the family's forward takes the labels as well (`labels`: DeepSeek-V3's multi-token
    prediction needs the tokens ahead; a chunked loss is computed in the forward); such a model
    gets them in training."""
    return (getattr(train_spec.loss_fn, "loss_fn", train_spec.loss_fn) is loss_from_forward
            or "labels" in inspect.signature(train_spec.model_cls.forward).parameters)


def loss_context(parallel_dims: ParallelDims) -> Callable[[], ContextManager]:
    """What the loss (and its backward) is computed in, training and validation alike: with loss
    parallelism, DTensor's loss_parallel, whose cross-entropy consumes vocabulary-sharded logits."""
    return loss_parallel if parallel_dims.loss_parallel_enabled else contextlib.nullcontext


def forward_backward(train_spec: TrainSpec, parallel_dims: ParallelDims, model_parts: list[torch.nn.Module],
                     pipeline: Pipeline | None, micro_batches: list, device: torch.device,
                     defer_sharded_reduction: bool = False, eos_id: int | None = None) -> torch.Tensor:
    """One optimizer step's forwards and backwards over its micro-batches (gradient accumulation);
    returns the step's loss on this rank (a pipeline's last stage holds it, the others zero).
    `train_spec.loss_fn`: a TokenWeightedLoss (`with_token_weights`), which counts the step's valid
    tokens first. `defer_sharded_reduction`: training.defer_sharded_gradient_reduction. `eos_id`:
    document masking's separator (`document_mask_eos`), None without it."""
    accum = len(micro_batches)
    with_labels = takes_labels(train_spec)
    in_loss_context = loss_context(parallel_dims)
    step_loss = torch.zeros((), device=device)
    on_device = [(batch[0], *shard_batch((batch[0].to(device, non_blocking=True),
                                          batch[1].to(device, non_blocking=True)), parallel_dims.cp_mesh),
                  batch_documents(batch, device, parallel_dims.cp_enabled))
                 for batch in micro_batches]
    train_spec.loss_fn.start_step([labels for _, _, labels, _ in on_device])
    for micro, (batch_inputs, inputs, labels, documents) in enumerate(on_device):
        # Document ids from the whole sequences: the host's under CP (cp_attention plans from them),
        # else the device's (unsharded without CP).
        extra = model_kwargs(batch_inputs if parallel_dims.cp_enabled else inputs, eos_id, documents)
        if with_labels:
            extra["labels"] = labels
        if accum > 1:
            _skip_reductions(parallel_dims, model_parts, micro == accum - 1, defer_sharded_reduction)
        with in_loss_context():
            if pipeline is not None:
                loss = pipeline.forward_backward(inputs, labels, device, **extra)
            else:
                loss = train_spec.loss_fn(model_parts[0](inputs, **extra), labels)
                loss.backward()
        step_loss += loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
    return step_loss
