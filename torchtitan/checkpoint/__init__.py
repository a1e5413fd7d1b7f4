"""CheckpointManager: saves and restores every Stateful of a run through torch.distributed.checkpoint.

Checkpoints are `step-N` folders under job.dump_folder/checkpoint.folder. Model and optimizer
state use fully qualified parameter names (PyTorch's distributed state-dict helpers), so a
checkpoint loads under any parallel layout: DCP reshards on load. `step-0` is a seed
checkpoint: model weights only, written by one process right after initialisation.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.config_manager import JobConfig

logger = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step-(\d+)$")


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
    """All model parts as one flat state dict keyed by original parameter names."""

    def __init__(self, model_parts: list[nn.Module]):
        self.model_parts = model_parts

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.model_parts:
            merged.update(get_model_state_dict(part))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.model_parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


class DataState(Stateful):
    """The data position. Keys name data shards, which are global, so each rank writes and reads
    only its own shards and the position survives a change of data-parallel degree."""

    def __init__(self, dataloader: Any):
        self.dataset = dataloader.dataset

    def state_dict(self) -> dict[str, Any]:
        return {key: pickle.dumps(value) for key, value in self.dataset.state_dict().items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.dataset.load_state_dict({key: pickle.loads(value) for key, value in state_dict.items()})


class CheckpointManager:
    def __init__(
        self,
        job_config: JobConfig,
        model_parts: list[nn.Module],
        optimizers: Stateful,
        lr_schedulers: Stateful,
        dataloader: Any,
        train_state: TrainState,
    ):
        c = job_config.checkpoint
        self.enabled = c.enable_checkpoint or c.create_seed_checkpoint
        self.folder = os.path.join(job_config.job.dump_folder, c.folder)
        self.interval = c.interval
        self.load_step = c.load_step
        self.initial_load_path = c.initial_load_path
        self.model = ModelState(model_parts)
        self.states: dict[str, Stateful] = {
            "model": self.model,
            "optimizer": optimizers,
            "lr_scheduler": lr_schedulers,
            "dataloader": DataState(dataloader),
            "train_state": train_state,
        }

    def _steps_on_disk(self) -> list[int]:
        if not os.path.isdir(self.folder):
            return []
        return sorted(int(m.group(1)) for d in os.listdir(self.folder) if (m := _STEP_DIR.match(d)))

    def load(self) -> bool:
        """Restores the newest (or checkpoint.load_step) checkpoint; falls back to initial_load_path."""
        steps = self._steps_on_disk() if self.enabled else []
        if self.load_step >= 0 and self.enabled:
            if self.load_step not in steps:
                raise FileNotFoundError(f"checkpoint.load_step {self.load_step}: no step-{self.load_step} in {self.folder}")
            steps = [self.load_step]
        if steps:
            step = steps[-1]
            path = os.path.join(self.folder, f"step-{step}")
            # The seed checkpoint holds model weights only.
            states = {"model": self.model} if step == 0 else self.states
        elif self.initial_load_path:
            path, states = self.initial_load_path, {"model": self.model}
            if not os.path.isdir(path):
                raise FileNotFoundError(f"checkpoint.initial_load_path {path} is not a folder")
        else:
            return False
        start = time.perf_counter()
        dcp.load(states, checkpoint_id=path)
        logger.info(f"loaded {', '.join(states)} from {path} in {time.perf_counter() - start:.2f}s")
        return True

    def save(self, step: int, force: bool = False) -> None:
        if not self.enabled or (step % self.interval and not force):
            return
        path = os.path.join(self.folder, f"step-{step}")
        states = {"model": self.model} if step == 0 else self.states
        start = time.perf_counter()
        dcp.save(states, checkpoint_id=path)
        logger.info(f"saved checkpoint {path} in {time.perf_counter() - start:.2f}s")
