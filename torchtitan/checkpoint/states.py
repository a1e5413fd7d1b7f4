"""The Stateful pieces of a run that a checkpoint holds, besides optimizers and LR schedulers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful


@dataclass
class TrainState(Stateful):
    step: int = 0
    tokens_seen: int = 0  # global, all data-parallel ranks together
    # fault_tolerance: batches each replica group's data shard gave to committed steps (its ledger;
    # empty otherwise, and then not in the checkpoint).
    data_consumed: list[int] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        state = {"step": torch.tensor(self.step), "tokens_seen": torch.tensor(self.tokens_seen)}
        if self.data_consumed:
            state["data_consumed"] = torch.tensor(self.data_consumed, dtype=torch.int64)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])
        if "data_consumed" in state_dict:
            self.data_consumed[:] = [int(c) for c in state_dict["data_consumed"]]


class ModelState(Stateful):
    """All model parts as one flat state dict keyed by original parameter names (whatever the
    layout: FSDP shards and TP slices are DTensors that DCP reassembles and reshards). `select`,
    when given, keeps the names it accepts: a LoRA run saves and loads its adapters and its
    frozen base apart."""

    def __init__(self, model_parts: list[nn.Module], select: Callable[[str], bool] | None = None):
        self.model_parts = model_parts
        self.select = select

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.model_parts:
            merged.update(get_model_state_dict(part))
        if self.select is not None:
            merged = {k: v for k, v in merged.items() if self.select(k)}
        return merged

    def exported(self, dtype: torch.dtype) -> dict[str, Any]:
        """The state dict with floating-point tensors cast to `dtype` (weights-only exports)."""
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.state_dict().items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Each part takes its own keys; a pipeline stage ignores the other stages' weights.
        for part in self.model_parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


class DataState(Stateful):
    """The data position. Keys name data shards, which are global, so each rank writes and reads
    only its own shards and the position survives a change of data-parallel degree."""

    def __init__(self, dataloader: Any):
        self.dataset = dataloader.dataset

    def state_dict(self) -> dict[str, Any]:
        # Plain dicts, lists and numbers, which load with torch.load(weights_only=True).
        return self.dataset.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state_dict)


class RNGState(Stateful):
    """This rank's random-number generators (CPU, and CUDA when present), keyed by global rank.

    Generator states belong to a rank, so they are restored only under the layout that wrote
    them; under another layout the new run keeps its freshly seeded generators.
    """

    def __init__(self, rank: int):
        self.key = f"rank_{rank}"

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return {self.key: state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict[self.key]
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


def flatten(prefix: str, value: Any) -> dict[str, Any]:
    """DCP's key for every leaf of a nested state dict (dict keys joined with dots)."""
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(flatten(f"{prefix}.{key}" if prefix else str(key), item))
    return out


def _without(prefix: str, value: dict[str, Any], skip: set[str]) -> dict[str, Any]:
    out = {}
    for key, item in value.items():
        name = f"{prefix}.{key}"
        if isinstance(item, dict):
            out[key] = _without(name, item, skip)
        elif name not in skip:
            out[key] = item
    return out


def _filled(loaded: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    out = dict(current)
    for key, item in loaded.items():
        out[key] = _filled(item, current[key]) if isinstance(item, dict) and isinstance(current.get(key), dict) else item
    return out


class PartialState(Stateful):
    """A Stateful loaded without some of its entries (`skip`: DCP keys under `prefix`), which keep
    their current values: DCP reads only the rest, and the state receives a complete dict."""

    def __init__(self, state: Stateful, prefix: str, skip: set[str]):
        self.state, self.prefix, self.skip = state, prefix, skip
        self._current: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        self._current = self.state.state_dict()
        return _without(self.prefix, self._current, self.skip)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state.load_state_dict(_filled(state_dict, self._current))
