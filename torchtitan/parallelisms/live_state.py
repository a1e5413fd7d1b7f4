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
        # The transport hands every tensor over on the host: which entries this rank keeps on the device
        # (a fused or low-precision optimizer's step count) tells a receiver without them where to put them.
        on_device = {idx: [k for k, v in entries.items() if isinstance(v, torch.Tensor) and v.device.type != "cpu"]
                     for idx, entries in sd["state"].items()}
        optim.append({"state": state, "param_groups": groups, "on_device": on_device})
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
            on_device = received.get("on_device", {}).get(idx, ())
            for key, value in entries.items():
                current[key] = _state_entry(p, value, current.get(key), key in on_device)
        for group, received_group in zip(optimizer.param_groups, received["param_groups"], strict=True):
            group.update(received_group)
    lr_schedulers.load_state_dict(state["lr_scheduler"])
    # The step count is the manager's (ReplicaGroups.commit): the peer's train_state.step may already
    # count the step it has begun when torchft reads this in its quorum thread.
    train_state.tokens_seen = int(state["train_state"]["tokens_seen"])


def _state_entry(p: torch.Tensor, value: Any, current: Any, on_device: bool) -> Any:
    """One optimizer state entry of parameter `p` from the peer's `value` (a local shard, or a
    scalar such as the step count), written into this rank's `current` entry where it has one.
    An optimizer that has not stepped yet (a group restarted before its first checkpoint) has no
    entry: a parameter-shaped one is built as the optimizers build theirs, `zeros_like(p)`, which
    keeps a DTensor parameter's mesh, placements (FSDP's and HSDP's shards, _StridedShard under
    FSDP x TP) and uneven shard sizes, then filled with the peer's shard; any other (a scalar such
    as the step count) is put where the peer keeps it: on the parameter's device or on the host."""
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(current, torch.Tensor):  # shapes match: the groups' configurations and layouts are checked equal
        local_shard(current).copy_(value)
        return current
    if value.dim() > 0 and value.shape == local_shard(p).shape:
        entry = torch.zeros_like(p, dtype=value.dtype)
        local_shard(entry).copy_(value)
        return entry
    return value.to(local_shard(p).device, copy=True) if on_device else value.clone()
