"""The state a recovering replica group is sent by a peer (parallelisms/fault_tolerance.py): this
rank's parameter shards, buffers and optimizer state as plain tensors, with the LR schedule and the
token count. Rank r of every group has the same layout, so names and local shapes match without
resharding; torchft carries the tensors over the cross-group process group."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.errors import ConfigError


def local_shard(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t



def named_tensors(model_parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    named = {}
    for i, part in enumerate(model_parts):
        for name, t in [*part.named_parameters(), *part.named_buffers()]:
            named[f"{i}.{name}"] = t
    return named


def live_state(named: dict[str, torch.Tensor], optimizers: Any, lr_schedulers: Any, train_state: Any) -> dict[str, Any]:
    """References, not copies: torchft serves them before this rank's next optimizer step."""
    model = {name: local_shard(t).detach() for name, t in named.items()}
    optim = []
    for optimizer in optimizers.optimizers:
        sd = optimizer.state_dict()
        state = {idx: {k: local_shard(v).detach() if isinstance(v, torch.Tensor) else v for k, v in entries.items()}
                 for idx, entries in sd["state"].items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
        optim.append({"state": state, "param_groups": groups})
    return {"model": model, "optimizer": optim, "lr_scheduler": lr_schedulers.state_dict(),
            "train_state": {"step": train_state.step, "tokens_seen": train_state.tokens_seen}}


@torch.no_grad()
def load_live_state(state: dict[str, Any], own: dict[str, torch.Tensor], optimizers: Any, lr_schedulers: Any,
                    train_state: Any) -> None:
    """Takes a peer's live_state into this rank's model (`own`: its named parameter shards and
    buffers), optimizer, schedule and counters. The step in progress becomes the peer's next one."""
    if set(own) != set(state["model"]):
        raise ConfigError("fault_tolerance: the peer's model has other parameters than this group's; the groups "
                          "must train the same model with the same layout")
    for name, t in own.items():
        local, received = local_shard(t), state["model"][name]
        if local.shape != received.shape:
            raise ConfigError(f"fault_tolerance: the peer's {name} shard has shape {tuple(received.shape)}, this "
                              f"rank's {tuple(local.shape)}; the groups must use the same layout and rank count")
        local.copy_(received)
    for optimizer, received in zip(optimizers.optimizers, state["optimizer"], strict=True):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for idx, entries in received["state"].items():
            p = params[int(idx)]
            current = optimizer.state.setdefault(p, {})
            for key, value in entries.items():
                if not isinstance(value, torch.Tensor):
                    current[key] = value
                elif key in current and isinstance(current[key], torch.Tensor):
                    local_shard(current[key]).copy_(value)
                elif isinstance(p, DTensor) and value.shape == p.tolocal_shard().shape and value.dim() > 0:
                    current[key] = DTensor.fromlocal_shard(value.clone(), p.device_mesh, p.placements, run_check=False,
                                                      shape=p.shape, stride=p.stride())
                else:
                    current[key] = value.clone()
        for group, received_group in zip(optimizer.param_groups, received["param_groups"], strict=True):
            group.update(received_group)
    lr_schedulers.load_state_dict(state["lr_scheduler"])
    # The step count is the manager's (ReplicaGroups.commit): the peer's train_state.step may already
    # count the step it has begun when torchft reads this in its quorum thread.
    train_state.tokens_seen = int(state["train_state"]["tokens_seen"])
