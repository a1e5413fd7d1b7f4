"""Asynchronous checkpoint saving: stage a copy of the state, write it while training goes on.

`async`: each save copies the state into fresh host memory (the only time the training loop
waits), then a background thread of this process writes it. `async_with_pinned_mem`: the copies
go into host buffers that are allocated once and reused by every save (pinned on CUDA, so the
device-to-host copy is fast; shared memory everywhere), and a separate checkpoint process writes
them, so writing does not compete with training for this process's Python interpreter.

Both use a gloo process group of their own: the background writer's collectives must never
interleave with the training loop's on the same group.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from torchtitan.runtime.torch_compat import checkpoint as torch_compat_checkpoint

logger = logging.getLogger(__name__)


class AsyncSaver:
    def __init__(self, mode: str):
        self.mode = mode
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.stager: DefaultStager | None = None
        self.executor = AsyncCheckpointerType.THREAD
        if mode == "async_with_pinned_mem":
            pinned = torch.cuda.is_available()
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=True,
                                                       use_async_staging=False, use_non_blocking_copy=False))
            # DCP's checkpoint process joins a process group of its own, so it needs a distributed
            # run; a single process writes from a thread instead.
            writer = "a checkpoint process" if dist.is_initialized() else "a background thread"
            if dist.is_initialized():
                self.executor = AsyncCheckpointerType.PROCESS
            logger.info(f"asynchronous checkpoints: reused {'pinned' if pinned else 'shared'} host buffers, "
                        f"written by {writer}")
        else:
            logger.info("asynchronous checkpoints: staged in host memory, written by a background thread")

    def save(self, states: dict[str, Any], path: str, planner: Any = None) -> Future:
        result = dcp.async_save(states, checkpoint_id=path, process_group=self.group, no_dist=self.group is None,
                                async_checkpointer_type=self.executor, async_stager=self.stager, planner=planner)
        return result.upload_completion if isinstance(result, AsyncSaveResponse) else result

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
        if self.executor == AsyncCheckpointerType.PROCESS:
            # The checkpoint process is a daemon of this process; ranks leave through os._exit,
            # which skips multiprocessing's clean-up, so end it explicitly.
            torch_compat_checkpoint.end_async_checkpoint_process()
