"""This rank's place in the job and its process group: joining it, shortening its timeout once
start-up is over, ending it, and leaving the process."""

from __future__ import annotations

import datetime
import gc
import logging
import os
import sys

import torch
import torch.distributed as dist


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def init_distributed(dev_type: str, timeout_seconds: float, trace_buf_size: int = 0,
                     dump_folder: str = "") -> torch.device:
    """Joins the process group (when launched with more than one rank) and picks this rank's device.

    On CUDA, NCCL carries GPU tensors and gloo any CPU tensors; on CPU everything uses gloo. On
    CUDA, NCCL's flight recorder keeps the last `trace_buf_size` collectives of each rank and
    dumps them into <dump_folder>/hang_dumps/ when a collective times out (variables set by the
    user win).
    """
    if dev_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        if trace_buf_size > 0:
            os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(trace_buf_size))
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
            folder = os.path.join(os.path.abspath(dump_folder or "."), "hang_dumps")
            os.makedirs(folder, exist_ok=True)
            os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", os.path.join(folder, "nccl-timeout-trace-rank-"))
    else:
        device = torch.device("cpu")
    if world_size() > 1 and not dist.is_initialized():
        backend = "cuda:nccl,cpu:gloo" if dev_type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_seconds)
        store = _store_of_this_attempt(timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=rank(), world_size=world_size(), timeout=timeout)
    return device


def _store_of_this_attempt(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, the rendezvous store of its agent, in a namespace of this attempt's own.

    The agent's store outlives a restart (MAX_RESTARTS), and with it the keys the failed attempt's
    ranks wrote, gloo's listening addresses among them: the restarted ranks would read those at
    once and connect to ports of dead processes (refused, or worse, taken by another socket, which
    hangs the connect). Each attempt therefore keys its process group under its restart count.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size(), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"/torchtitan/attempt_{attempt}", agent)


def die_with_launcher() -> None:
    """On Linux, a rank started by a launcher is killed when the launcher dies, so a launcher
    ended without warning (kill -9, out of host memory) leaves no rank behind holding devices."""
    if world_size() == 1 or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    launcher = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() != launcher:  # the launcher was gone before the line above took effect
        os._exit(128 + int(signal.SIGKILL))


def set_timeout(seconds: float) -> None:
    """Shortens the collective timeout once start-up (first compiles, checkpoint loads) is over,
    so a hung rank is reported in seconds rather than after the generous start-up timeout."""
    if dist.is_initialized():
        from torchtitan.runtime.torch_compat import c10d as torch_compat_c10d

        torch_compat_c10d.set_default_timeout(seconds)


def shutdown(clean: bool) -> None:
    """Ends the process group. After a clean run every rank frees its model and pending
    collective work first (the trainer disables automatic GC, so DDP's reducer and FSDP's state
    sit in reference cycles until collected), then waits for its peers, so no rank tears down
    while another still communicates. After an error there is no barrier: a peer may never come."""
    gc.enable()
    gc.collect()
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """Leaves a distributed process without Python's interpreter finalization.

    Gloo's worker threads can still release Python objects while the interpreter is being torn
    down, which aborts the process ("terminate called without an active exception", SIGABRT) after
    a run that finished correctly. Everything that must outlive the run (logs, metrics, checkpoints)
    is flushed or closed before this point, so skipping finalization loses nothing.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
