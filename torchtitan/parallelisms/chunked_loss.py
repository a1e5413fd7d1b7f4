"""Chunked cross-entropy (training.loss_chunk_size): the loss computed inside the output projection's
forward, a chunk of sequence positions at a time, so that neither the whole (batch, seq, vocab)
logits nor their fp32 upcast and log-probabilities ever exist.

Why inside the output module: under FSDP the output weight is gathered only within its unit's
forward and backward, and under tensor parallelism it is a vocabulary-sharded DTensor whose
logits feed loss parallelism; a loss function reading `model.output.weight` afterwards would
meet a shard. So `model.output` becomes a `ChunkedLossHead`: an nn.Linear with the same `weight`
(state dicts, checkpoints, tied embeddings and Hugging Face names are unchanged) that also applies
the padded-vocabulary mask. Given labels, it returns the mean loss (over labels != -100, as
models/loss.py's); without (generation, export, a stage before the last) it returns logits.

The labels reach it through a forward pre-hook on the model (or pipeline stage) module, which
takes a `labels` keyword from the trainer and drops it before the forward, unless the family's
forward takes labels itself (DeepSeek-V3). The trainer's loss function then passes the loss
through (`loss_from_forward`).

Each chunk's projection, upcast and cross-entropy run under activation checkpointing: forward
keeps nothing of them but the chunk's loss sum, and backward recomputes one chunk's logits at a
time. The price is the output projection's forward once more (a third more of its FLOPs).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.utils.checkpoint import checkpoint

from torchtitan.datasets.text_dataset import IGNORE_INDEX
from torchtitan.errors import ConfigError


class ChunkedLossHead(nn.Linear):
    """The output projection, bias-free, that computes the loss chunk by chunk when labels are set
    (`labels`, consumed by the next forward)."""

    def __init__(self, output: nn.Linear, vocab_mask: nn.Module | None, chunk_size: int):
        nn.Module.__init__(self)  # no new weight: the model's own Parameter (tied or not) is kept
        if output.bias is not None:
            raise ValueError("ChunkedLossHead replaces a bias-free output projection")
        self.in_features, self.out_features = output.in_features, output.out_features
        self.weight = output.weight
        self.register_parameter("bias", None)
        self.vocab_mask = vocab_mask
        self.chunk_size = chunk_size
        self.labels: torch.Tensor | None = None
        # Tensor parallelism without loss parallelism: each chunk's vocabulary-sharded logits are
        # gathered whole (set by apply_head_tp).
        self.replicate_logits = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        labels, self.labels = self.labels, None
        if labels is None:
            return self.logits(h, self.weight)
        sums = [checkpoint(self._loss_sum, h_chunk, self.weight, labels_chunk, use_reentrant=False)
                if torch.is_grad_enabled() else self._loss_sum(h_chunk, self.weight, labels_chunk)
                for h_chunk, labels_chunk in zip(h.split(self.chunk_size, dim=1), labels.split(self.chunk_size, dim=1))]
        # A device-side count (no host read), clamped as models/loss.py's: an all-ignored batch gives 0.
        return torch.stack(sums).sum() / (labels != IGNORE_INDEX).sum().clamp(min=1)

    def logits(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, weight)
        if self.replicate_logits:
            logits = logits.redistribute(placements=[Replicate()]).to_local()
        return self.vocab_mask(logits) if self.vocab_mask is not None else logits

    def _loss_sum(self, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.logits(h, weight)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
                               ignore_index=IGNORE_INDEX)


def loss_from_forward(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss function of a chunked-loss model: its forward already returned the mean loss."""
    return output


def _deliver_labels(module: nn.Module, args: tuple, kwargs: dict, keep: bool) -> tuple[tuple, dict]:
    labels = kwargs.get("labels") if keep else kwargs.pop("labels", None)
    head = getattr(module, "output", None)
    if isinstance(head, ChunkedLossHead):
        head.labels = labels
    return args, kwargs


def install_chunked_loss(model: nn.Module, chunk_size: int) -> None:
    """Replaces `model.output` (an nn.Linear; None on a pipeline stage before the last) by a
    ChunkedLossHead that takes over the model's `vocab_mask`, and lets the model's forward take
    `labels`. Call on the meta-device model or stage, before it is parallelized."""
    output = getattr(model, "output", None)
    if output is not None:
        if type(output) is not nn.Linear or output.bias is not None:
            raise ConfigError(f"training.loss_chunk_size needs the model's output projection to be a bias-free "
                              f"nn.Linear named `output`; {type(model).__name__} has {type(output).__name__}; "
                              "set training.loss_chunk_size 0")
        model.output = ChunkedLossHead(output, getattr(model, "vocab_mask", None), chunk_size)
        if hasattr(model, "vocab_mask"):
            model.vocab_mask = None  # applied by the head, before the loss
    keep = "labels" in inspect.signature(model.forward).parameters
    model.register_forward_pre_hook(functools.partial(_deliver_labels, keep=keep), with_kwargs=True)


def apply_head_tp(head: ChunkedLossHead, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool,
                  sharded_mask: Callable[[int], nn.Module]) -> None:
    """The head's tensor-parallel layout, ColwiseParallel's for the output projection: the weight
    split by vocabulary rows, the hidden states gathered whole (from sequence shards under
    sequence parallelism). Each chunk's logits are vocabulary-sharded: kept so into the
    cross-entropy under loss parallelism (`sharded_mask(vocab_size)` masks the padding of each
    rank's slice), gathered otherwise. Without labels the head returns logits laid out as the
    plain output's."""
    seq = Shard(1) if sequence_parallel else Replicate()

    def shard_weight(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if module is head:
            module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight, mesh, [Shard(0)])))

    def gather_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        h = inputs[0]
        if not isinstance(h, DTensor):
            h = DTensor.from_local(h, mesh, [seq], run_check=False)
        return (h.redistribute(placements=[Replicate()]), *inputs[1:])

    distribute_module(head, tp_mesh, shard_weight, input_fn=gather_input)
    head.replicate_logits = not loss_parallel
    if loss_parallel and head.vocab_mask is not None:
        head.vocab_mask = sharded_mask(head.vocab_mask.vocab_size)
