"""What a LoRA run's checkpoints hold and where its weights come from (docs/lora.md).

A LoRA run trains adapters beside a frozen base. With lora.save_adapters_only (the default) its
step checkpoints hold the adapters, their optimizer state and the run's other states, but not the
base, which is as large as the model and never changes: a resumed run reads the base from
checkpoint.initial_load_path again, then the adapters from its step checkpoint. The manifest says
which (`Manifest.lora`), so a checkpoint is read as it was written whatever the options are now,
and the exporters (scripts/convert_checkpoint.py) find the base it goes with.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from torch import nn

from torchtitan.checkpoint.folders import CheckpointError
from torchtitan.checkpoint.resume import ResumePoint, initial_weights
from torchtitan.checkpoint.states import ModelState
from torchtitan.config.job_config import JobConfig
from torchtitan.parallelisms.lora_linear import is_adapter_name

logger = logging.getLogger(__name__)

# What a load reads into the model: all of it, the frozen base only, or the adapters only.
WHOLE, BASE, ADAPTERS = "whole", "base", "adapters"


def manifest_record(job_config: JobConfig) -> dict[str, Any] | None:
    """Manifest.lora of this run's checkpoints; None without LoRA."""
    lora = job_config.lora
    if lora.rank == 0:
        return None
    base = job_config.checkpoint.initial_load_path
    return {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout, "target_modules": list(lora.target_modules),
            "adapters_only": lora.save_adapters_only, "base": os.path.abspath(base) if base else None}


def saved_state(model_parts: list[nn.Module], job_config: JobConfig) -> ModelState:
    """The model state a checkpoint of this run holds: the adapters alone under lora.save_adapters_only."""
    adapters_only = job_config.lora.rank > 0 and job_config.lora.save_adapters_only
    return model_state(model_parts, ADAPTERS if adapters_only else WHOLE)


def model_state(model_parts: list[nn.Module], which: str) -> ModelState:
    select = {WHOLE: None, BASE: lambda name: not is_adapter_name(name), ADAPTERS: is_adapter_name}[which]
    return ModelState(model_parts, select)


def loads_for(resume: ResumePoint, job_config: JobConfig) -> list[tuple[ResumePoint, str]]:
    """The loads that start this run from `resume`, in order, each with what it reads. Without
    LoRA, the checkpoint whole. With LoRA, weights only (a seed, a full model, a Hugging Face
    folder: the base) leave the adapters fresh; a step checkpoint of adapters alone needs its
    base first; one of a whole LoRA model is read whole."""
    record = (resume.manifest.lora if resume.manifest is not None else None) or {}
    if record and resume.weights_only:  # an initial_load_path that a LoRA run wrote
        merge = (f"merge its adapters into its base first (scripts/convert_checkpoint.py dcp-to-hf --lora-merge "
                 f"{resume.path} OUT) and start from OUT")
        if record.get("adapters_only"):
            raise CheckpointError(f"checkpoint.initial_load_path {resume.path} holds LoRA adapters only (rank "
                                  f"{record.get('rank')}, trained on {record.get('base')}), no model to start from; {merge}")
        if job_config.lora.rank == 0:
            raise CheckpointError(f"checkpoint.initial_load_path {resume.path} holds a model with LoRA adapters (rank "
                                  f"{record.get('rank')}); {merge}, or set lora.rank to train new adapters on its base")
    if job_config.lora.rank == 0:
        return [(resume, WHOLE)]
    if resume.weights_only or resume.hf:
        return [(resume, BASE)]
    if record and float(record.get("alpha", job_config.lora.alpha)) != job_config.lora.alpha:
        # The adapters' scale: trained at one and resumed at another, they would fit neither.
        raise CheckpointError(f"{resume.path} holds adapters trained with lora.alpha {record['alpha']:g}, but this run's "
                              f"lora.alpha is {job_config.lora.alpha:g}; resume with lora.alpha {record['alpha']:g}")
    if not record.get("adapters_only"):
        return [(resume, WHOLE)]
    path = job_config.checkpoint.initial_load_path
    if not path:
        recorded = f" (it was trained on {record['base']})" if record.get("base") else ""
        raise CheckpointError(f"{resume.path} holds LoRA adapters without their base model{recorded}; set "
                              "checkpoint.initial_load_path to the base model's checkpoint or Hugging Face folder")
    if record.get("base") and os.path.abspath(path) != record["base"]:
        logger.warning(f"{resume.path} was trained on the base {record['base']}; loading the base from "
                       f"checkpoint.initial_load_path {path} instead (the adapters fit only the weights they were "
                       "trained on)")
    return [(initial_weights(path, job_config.model.name), BASE), (resume, ADAPTERS)]
