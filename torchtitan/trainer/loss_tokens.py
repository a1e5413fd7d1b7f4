"""The training loss as the mean over the step's tokens that carry a loss, whatever the layout.

A label of IGNORE_INDEX carries no loss (training.mask_loss_after_eos, or any dataset that marks
positions so). A micro-batch's loss function returns the mean over its own labels that do carry
one; averaging those means would weigh a token by how many others share its micro-batch and rank,
so accumulation, data parallelism and context parallelism would each change the loss. Instead the
step's loss is the sum over every valid token of every micro-batch on every rank, divided by their
global count G: each micro-batch's mean is weighted by count x N / G, where N is the number of
ranks whose gradients the data-parallel reductions average (the loss mesh: dp_replicate x dp_shard
x cp), so that the average they take is the sum over ranks. Without ignored labels the weight is
exactly 1 / accumulation steps, as before.

G is counted on the device from the labels (no host read) and summed over the loss mesh with one
scalar all-reduce per step, before the first forward. A step where G is 0 (every label masked, e.g.
all-end-of-text data under mask_loss_after_eos) trains nothing: its loss and gradients are 0. Such
steps are counted on the device too, and the trainer reads the count at its step lines, which read
on the host anyway, to say so (Trainer.log).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from torchtitan.datasets.text_dataset import IGNORE_INDEX
from torchtitan.parallelisms.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)


def valid_count(labels: torch.Tensor) -> torch.Tensor:
    """Labels that carry a loss, as an int64 device scalar."""
    return (labels != IGNORE_INDEX).sum()


class TokenWeightedLoss:
    """The train spec's loss function (a mean over a micro-batch's valid labels) weighted by the
    micro-batch's share of the step's valid tokens; what a training step and the pipeline's
    schedule call. `summing()`: weighted by the count alone, so that validation adds up sums."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 parallel_dims: ParallelDims | None):
        self.loss_fn = loss_fn
        # Its loss mesh is read at the first step: the dry run wraps the loss before its (fake)
        # process group and meshes exist.
        self.parallel_dims = parallel_dims
        self.ranks = 1
        self.step_tokens: torch.Tensor | None = None  # G of the current step
        self.empty_steps: torch.Tensor | None = None  # steps with G = 0 since the last `steps_without_loss()`
        self._summing = False

    def start_step(self, labels: Sequence[torch.Tensor]) -> None:
        """Counts G over this rank's micro-batches (their local labels, after any context-parallel
        sharding) and every rank of the loss mesh."""
        total = torch.stack([valid_count(y) for y in labels]).sum()
        mesh = self.parallel_dims.loss_mesh if self.parallel_dims is not None else None
        if mesh is not None:
            self.ranks = mesh.size()
            dist.all_reduce(total, group=mesh.get_group())
        # A step with no valid label anywhere weighs every loss 0 (no NaN from 0 / 0).
        self.step_tokens = total.clamp(min=1).double()
        if self.empty_steps is None:
            self.empty_steps = torch.zeros((), dtype=torch.int64, device=total.device)
        self.empty_steps += total == 0

    def steps_without_loss(self) -> int:
        """The steps since the last call in which no label carried a loss on any rank. A host read:
        for the step lines only, which read the step's loss anyway."""
        if self.empty_steps is None:
            return 0
        count = int(self.empty_steps.item())
        self.empty_steps.zero_()
        return count

    @contextlib.contextmanager
    def summing(self) -> Iterator[None]:
        self._summing = True
        try:
            yield
        finally:
            self._summing = False

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        count = valid_count(labels)
        if self._summing:
            weight = count.float()
        elif self.step_tokens is None:
            raise RuntimeError("TokenWeightedLoss: start_step(labels) must count the step's tokens before its losses")
        else:
            # In float64: G reaches 2**24 (16M-token batches) and the weight must stay exact.
            weight = ((count * self.ranks).double() / self.step_tokens).float()
        return self.loss_fn(output, labels) * weight


class StepsWithoutLoss:
    """The steps of a run in which no label carried a loss on any rank, read from the loss function
    at each step line: the first such steps are warned about (once a run), and all are counted for the
    run's summary."""

    def __init__(self, loss_fn: Callable):
        self.loss_fn = loss_fn if isinstance(loss_fn, TokenWeightedLoss) else None
        self.total = 0

    def read(self, first_step: int, last_step: int) -> None:
        """After the step line of steps `first_step`..`last_step` (it has read their loss already)."""
        count = self.loss_fn.steps_without_loss() if self.loss_fn is not None else 0
        if count and not self.total:
            steps = last_step - first_step + 1
            which = f"step {last_step}" if steps == 1 else f"{count} of the {steps} steps {first_step}-{last_step}"
            logger.warning(f"{which} had no label that carries a loss, on any rank (every label masked: training.mask_loss_after_eos masks the one after each "
                           "end-of-text token): such a step's loss and gradient norm are 0 and it trains nothing; check "
                           "the data (said once; the run summary counts every such step)")
        self.total += count
