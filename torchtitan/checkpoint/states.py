"""The Stateful pieces of a run that a checkpoint holds, besides optimizers and LR schedulers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful


@dataclass
class TrainState(Stateful):
    step: int = 0
    tokens_seen: int = 0  # global, all data-parallel ranks together

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "tokens_seen": torch.tensor(self.tokens_seen)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])


class ModelState(Stateful):
    """All model parts as one flat state dict keyed by original parameter names (whatever the
    layout: FSDP shards and TP slices are DTensors that DCP reassembles and reshards)."""

    def __init__(self, model_parts: list[nn.Module]):
        self.model_parts = model_parts

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.model_parts:
            merged.update(get_model_state_dict(part))
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
