"""Checkpoints through torch.distributed.checkpoint: never lost, resumable under any layout.

- folders.py: `step-N` folders, the completion manifest, discovery, atomic publication, retention
- states.py: the run's Stateful pieces (model, data position, train state, RNG)
- safe_load.py: reading DCP folders without unpickling arbitrary objects
- resume.py: which checkpoint a run starts from
- fit.py: whether a checkpoint fits the model, decided from its metadata before loading
- model_args.py: the model args a manifest records, back as args, and which differences matter
- manager.py: the CheckpointManager that loads and saves
- failures.py: failed reads and writes as one line; the free-space check before a save
- async_save.py: background saving (`checkpoint.async_mode`)
- weights.py, hf_folder.py: weights-only checkpoints, torch.save files and Hugging Face folders in one
  process, for scripts/convert_checkpoint.py
"""

from torchtitan.checkpoint.folders import CheckpointError, CheckpointSaveError, Manifest
from torchtitan.checkpoint.manager import CheckpointManager
from torchtitan.checkpoint.resume import ResumePoint, find_resume_point
from torchtitan.checkpoint.states import TrainState

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointSaveError", "Manifest", "ResumePoint", "TrainState",
           "find_resume_point"]
