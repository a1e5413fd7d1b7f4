"""Process-group start-up, device choice, seeding and the collectives the training loop needs."""

from __future__ import annotations

import datetime
import gc
import logging
import os
import sys
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.errors import ConfigError


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_param_dtype(name: str, device_type: str) -> torch.dtype:
    """A config dtype name as a torch dtype; `auto` computes in bf16 on CUDA (tensor cores) and in
    fp32 on CPU, where fp32 is the reference precision for parity tests."""
    if name == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def check_device_features(job_config, dev_type: str) -> None:
    """Features that need a GPU, refused on other devices before any process group exists."""
    if job_config.experimental.enable_async_tensor_parallel and dev_type != "cuda":
        raise ConfigError("experimental.enable_async_tensor_parallel needs CUDA GPUs (symmetric memory); "
                          "this machine has none")


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


def set_determinism(seed: int, deterministic: bool) -> None:
    """Seeds every generator identically on all ranks; optionally forces deterministic kernels."""
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        # cuBLAS needs a fixed workspace to be deterministic.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def clip_grad_norm_(
    parameters: list[torch.nn.Parameter], max_norm: float, pp_mesh: DeviceMesh | None = None,
    uncounted: Sequence[torch.nn.Parameter] = (),
) -> torch.Tensor:
    """Clips gradients to a global L2 norm and returns that norm.

    With DTensor gradients (FSDP/TP) the norm is reduced over every mesh dim the gradients are
    sharded on. Plain-tensor gradients (parameters no parallelism touched, e.g. the norms under
    TP without sequence parallelism) are the same on every rank and are added once. With
    pipeline stages each rank holds only its stages' gradients, so the squared norms are also
    summed across pp. `uncounted` parameters (a second copy of a tied weight) are clipped but
    left out of the norm. max_norm <= 0 only measures.
    """
    params = [p for p in parameters if p.grad is not None]
    # foreach kernels cannot mix DTensors with plain tensors, nor DTensors of different meshes (under
    # TP without sequence parallelism, FSDP/HSDP leaves the norms on a mesh without the tp dim).
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    skip = {id(p) for p in uncounted}
    norms = []
    for group in ([p for p in g if id(p) not in skip] for g in groups.values()):
        if not group:
            continue
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0, foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:  # no parameter received a gradient (a pp rank still joins the sum below)
        total = torch.zeros((), device=pp_mesh.device_type if pp_mesh is not None else "cpu")
    else:
        total = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
    if pp_mesh is not None:
        total = total**2
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
        total = total.sqrt()
    if max_norm > 0:
        # One factor for every element whatever its placement, so the local shards are scaled
        # directly: a foreach over DTensors of mixed placements costs DTensor's sharding
        # propagation seconds of CPU per process on the first step (a third of a short 3-D run).
        # clip_grads_with_norm_ scales the `.grad` of the tensors it is given: here leaf aliases
        # of the local shards, each holding its shard as its gradient.
        holders = []
        for p in params:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            holder = local.detach()
            holder.grad = local
            holders.append(holder)
        torch.nn.utils.clip_grads_with_norm_(holders, max_norm, total)
    return total


def max_across_ranks(values: list[float]) -> list[float]:
    """Element-wise maximum of a few host-side numbers over all ranks (a no-op on one process).
    The tensor stays on the CPU, so on GPUs it travels over gloo without waiting for the device."""
    if not dist.is_initialized():
        return [float(v) for v in values]
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def slowest_and_median(seconds: float) -> tuple[int, float, float] | None:
    """(slowest rank, its seconds, the median over ranks) of a per-rank time; None on one process.
    Host-side, over gloo, like max_across_ranks."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    times = [torch.zeros((), dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(times, torch.tensor(seconds, dtype=torch.float64))
    values = [t.item() for t in times]
    slowest = max(range(len(values)), key=values.__getitem__)
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return slowest, values[slowest], median


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any rank (a no-op on a single process)."""
    return bool(max_across_ranks([flag])[0])


def sum_across(value: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Sum of a scalar over a mesh; the value itself on a single process."""
    if mesh is None:
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return value


def mean_across(value: torch.Tensor, mesh: DeviceMesh | None) -> float:
    """Mean of a scalar over a mesh (for logging); the value itself on a single process."""
    if mesh is None:
        return value.item()
    value = value.detach().to(torch.float64, copy=True)  # gloo has no AVG: sum, then divide
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return value.item() / mesh.size()



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
