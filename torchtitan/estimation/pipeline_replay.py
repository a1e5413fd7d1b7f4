"""One pipeline rank's share of a training step, replayed in the schedule's order without its
communication: how the dry run measures a pipeline rank.

Under PyTorch's fake process group nothing travels between ranks, and a pipeline schedule needs
what its neighbours send: the shapes of the tensors its stages receive (exchanged as objects on
the first step) and the tensors themselves. The replay takes the schedule's own action list for
this rank (`schedule.pipeline_order`) and runs each action on this rank's stage modules: a forward
(F) on a microbatch's tokens, or on a tensor shaped as the one a stage hands the next
(the first stage's output, `Pipeline.first_stage`); a backward (B, or the weight half W of a zero-bubble schedule)
from the microbatch's loss on the last stage, or from a gradient shaped as the stage's output
elsewhere. What a stage keeps between its forward and backward of a microbatch is then what the
real schedule keeps, so the memory peak is the real one, up to what the replay leaves out:

- the receive and send buffers themselves (one microbatch boundary tensor each, in flight);
- a zero-bubble schedule's input-gradient half (I) is not run apart from its weight half: the
  activations stay until W, as they largely do in the real split backward.

Gradients are reduced by the last backward of each stage (FSDP's gradient sync and resharding are
held off until then, as the schedule does until its REDUCE_GRAD action).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtitan.parallelisms.pipeline_runtime import Pipeline

_FORWARD, _BACKWARDS = "F", ("B", "W")


def _compute_actions(order: list[Any]) -> list[tuple[str, int, int]]:
    """(kind, stage, microbatch) of every compute action, overlapped pairs (DualPipeV) unrolled.

    Microbatches are numbered by occurrence: a stage's k-th forward and k-th backward are
    microbatch k. All microbatches have the same shapes, so this keeps what the order says about
    memory (how many are in flight) and does not depend on the indices, which some schedules'
    informational orders get wrong (PyTorch 2.13's 1F1B numbers the last stage's from 1)."""
    actions, seen = [], {}
    for action in order:
        if action is None:
            continue
        for one in action.sub_actions or (action,):
            kind = one.computation_type.value
            if kind in (_FORWARD, *_BACKWARDS):
                key = (one.stage_index, kind == _FORWARD)
                actions.append((kind, one.stage_index, seen.get(key, 0)))
                seen[key] = seen.get(key, 0) + 1
    return actions


def _fsdp_roots(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _sync_gradients(module: nn.Module, now: bool) -> None:
    for root in _fsdp_roots(module):
        root.set_is_last_backward(now)
        root.set_reshard_after_backward(now)
        root.set_requires_gradient_sync(now)


def replayable(pipeline: Pipeline) -> bool:
    return bool(pipeline.stage_ids) and pipeline.microbatch_loss is not None and pipeline.first_stage is not None


class PipelineReplay:
    """`first_stage`: the first stage's module, materialised (this rank's own or one built for the
    purpose): its output gives the shape of what a stage receives."""

    def __init__(self, pipeline: Pipeline, pp_rank: int, first_stage: nn.Module, microbatch: torch.Tensor):
        """`microbatch`: tokens of one microbatch, from which the boundary's shape is learnt now,
        before any tracking (a first stage built for the purpose is not this rank's memory)."""
        if not replayable(pipeline):
            raise NotImplementedError("this model's pipelining_fn does not describe its stages for a replay "
                                      "(Pipeline.stage_ids, microbatch_loss, first_stage)")
        self.pipeline = pipeline
        self.modules = dict(zip(pipeline.stage_ids, pipeline.model_parts))
        self.boundary = _boundary(first_stage, microbatch) if any(s != 0 for s in self.modules) else None
        self.actions = _compute_actions(pipeline.schedule.pipeline_order[pp_rank])
        # The last backward of each stage reduces its gradients (FSDP's sync held off until then).
        self.last_backward = {}
        for index, (kind, stage, _) in enumerate(self.actions):
            if kind in _BACKWARDS:
                self.last_backward[stage] = index

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, /, **kwargs: torch.Tensor) -> torch.Tensor:
        """Replays this rank's actions for one batch; returns the summed microbatch losses (on the
        last stage; zero elsewhere), scaled as the schedule's. `kwargs` (document_ids; labels for a
        model that takes them, such as multi-token prediction) reach every stage's forward, cut
        into microbatches as the schedule cuts them."""
        p = self.pipeline
        tokens, targets = inputs.tensor_split(p.microbatches), labels.tensor_split(p.microbatches)
        extras = [{k: v.tensor_split(p.microbatches)[mb] for k, v in kwargs.items()} for mb in range(p.microbatches)]
        last = p.num_stages - 1
        boundary = self.boundary
        for module in self.modules.values():
            _sync_gradients(module, False)
        # Per (stage, microbatch) in flight: what the backward starts from, and the stage's output,
        # which the real stage keeps until then too (on the last stage: the logits, beside the loss).
        kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        losses = []
        for index, (kind, stage, mb) in enumerate(self.actions):
            module = self.modules[stage]
            if kind == _FORWARD:
                x = tokens[mb] if stage == 0 else torch.empty_like(boundary).requires_grad_()
                out = module(x, **extras[mb])
                start = out
                if stage == last:
                    start = p.microbatch_loss(out, targets[mb])
                    losses.append(start.detach().full_tensor() if isinstance(start, DTensor) else start.detach())
                kept[(stage, mb)] = (start, out)
            elif kind in _BACKWARDS:
                if index == self.last_backward[stage]:
                    _sync_gradients(module, True)
                start, _ = kept.pop((stage, mb))
                grad = None if stage == last else torch.ones_like(start)
                torch.autograd.backward(start, grad)
        for module in self.modules.values():
            for root in _fsdp_roots(module):
                root.reshard()
        if not losses:
            return torch.zeros((), device=inputs.device)
        return torch.stack(losses).sum()


def _boundary(first_stage: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """What the first stage hands the second for a microbatch of `tokens` (every stage boundary of
    a decoder carries the same): the first stage's output, without gradients; the stage is then
    resharded to the state a step starts from."""
    with torch.no_grad():
        out = first_stage(tokens)
    for root in _fsdp_roots(first_stage):
        root.reshard()
    return out
