"""Training metrics: one console line per log step, TensorBoard scalars, throughput, MFU, memory."""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from torchtitan.config_manager import JobConfig

logger = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s per device (no sparsity), by a substring of the CUDA device name.
_GPU_PEAK_BF16 = (("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12))


def cpu_peak_flops(dtype: torch.dtype = torch.float32, seconds: float = 0.3) -> float:
    """Measures this process's matmul FLOP/s in `dtype` with its current thread count.

    CPUs have no datasheet figure that matches what PyTorch reaches, so MFU on CPU is relative to
    this short probe of the same kernels the model uses (bf16 may use AMX tiles, far faster).
    """
    n = 512
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):  # warm-up: thread pool start, caches
        a @ b
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / elapsed


def peak_flops(device: torch.device, compute_dtype: torch.dtype) -> float:
    """Peak matmul FLOP/s of one device in the dtype the model computes in."""
    if device.type != "cuda":
        return cpu_peak_flops(compute_dtype)
    name = torch.cuda.get_device_name(device)
    peak = next((value for key, value in _GPU_PEAK_BF16 if key in name), None)
    if peak is None:
        logger.warning(f"unknown GPU {name!r}: MFU is computed against the H100 SXM peak")
        peak = 989e12
    # fp32 matmuls run at TF32 rate at best: half the bf16 tensor-core rate.
    return peak if compute_dtype in (torch.bfloat16, torch.float16) else peak / 2


def local_state_bytes(model_parts: list[torch.nn.Module], optimizers) -> tuple[int, int]:
    """Bytes of parameters and of optimizer state this rank holds (its shards under FSDP)."""

    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = sum(nbytes(p) for part in model_parts for p in part.parameters())
    state = sum(nbytes(v) for opt in optimizers for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)  # the scalar step counters are negligible
    return params, state


def memory_gib(device: torch.device) -> tuple[float, float]:
    """(peak, current) memory of this rank in GiB: CUDA max active / reserved, or CPU process RSS."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return stats.get("active_bytes.all.peak", 0) / 2**30, stats.get("reserved_bytes.all.current", 0) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return peak / 2**30, current / 2**30


def _open_jsonl(path: str, resumed_step: int):
    """Opens metrics.jsonl for appending. A fresh run starts it anew; a resumed run keeps the rows
    up to its checkpoint's step and drops later ones, which an interrupted job logged but will
    now train again, so that every step appears once."""
    if resumed_step <= 0 or not os.path.exists(path):
        return open(path, "w")
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= resumed_step]
    f = open(path, "w")
    f.writelines(kept)
    return f


class _Colors:
    def __init__(self, enabled: bool):
        codes = {"cyan": "\033[36m", "green": "\033[32m", "yellow": "\033[33m", "blue": "\033[34m",
                 "magenta": "\033[35m", "red": "\033[31m", "reset": "\033[39m"}
        for name, code in codes.items():
            setattr(self, name, code if enabled else "")


@dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: float  # tokens this rank processed since the last log line, / (tp x cp x pp)
    seconds: float  # wall time since the last log line
    data_seconds: float  # of which spent waiting for batches
    # Pipeline only: the share of the schedule's time that the pp ranks (on average) spent not
    # computing, i.e. the bubble plus waiting for neighbours.
    pp_bubble: float | None = None


class MetricsLogger:
    """Turns step measurements into throughput, MFU and memory figures; prints and records them."""

    def __init__(self, job_config: JobConfig, device: torch.device, flops_per_token: int, rank: int,
                 compute_dtype: torch.dtype = torch.float32, resumed_step: int = 0):
        self.device = device
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops(device, compute_dtype)
        self.colors = _Colors(not job_config.metrics.disable_color_printing)
        self.writer = None
        m = job_config.metrics
        self.jsonl = None
        if m.save_jsonl and rank == 0:
            os.makedirs(job_config.job.dump_folder, exist_ok=True)
            self.jsonl = _open_jsonl(os.path.join(job_config.job.dump_folder, "metrics.jsonl"), resumed_step)
        if m.enable_tensorboard and (rank == 0 or not m.rank_0_only):
            from torch.utils.tensorboard import SummaryWriter

            folder = os.path.join(job_config.job.dump_folder, m.save_tb_folder)
            if not m.rank_0_only:
                folder = os.path.join(folder, f"rank_{rank}")
            self.writer = SummaryWriter(folder)
            logger.info(f"TensorBoard scalars go to {folder}")
        logger.info(f"peak FLOP/s per device for MFU: {self.peak_flops / 1e12:.3f} T ({device.type}, {compute_dtype})")

    def log(self, s: StepMetrics) -> dict[str, float]:
        tps = s.tokens / s.seconds
        tflops = self.flops_per_token * tps / 1e12
        mfu = 100 * tflops * 1e12 / self.peak_flops
        peak_mem, current_mem = memory_gib(self.device)
        values = {
            "loss": s.loss, "grad_norm": s.grad_norm, "lr": s.lr, "tokens_per_second": tps,
            "tflops": tflops, "mfu_percent": mfu, "memory_peak_gib": peak_mem,
            "memory_current_gib": current_mem, "data_loading_percent": 100 * s.data_seconds / s.seconds,
        }
        if s.pp_bubble is not None:
            values["pp_bubble_percent"] = 100 * s.pp_bubble
        bubble = f"  bubble: {100 * s.pp_bubble:.1f}%" if s.pp_bubble is not None else ""
        c = self.colors
        logger.info(
            f"{c.red}step: {s.step:2}  {c.green}loss: {s.loss:7.4f}  {c.reset}grad_norm: {s.grad_norm:7.4f}  "
            f"lr: {s.lr:.2e}  {c.yellow}memory: {peak_mem:5.2f}GiB peak  "
            f"{c.blue}tps: {tps:,.0f}  {c.cyan}tflops: {tflops:,.3f}  {c.magenta}mfu: {mfu:.2f}%  "
            f"{c.reset}data: {values['data_loading_percent']:.1f}%{bubble}"
        )
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(f"train/{name}", value, s.step)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": s.step, **values}) + "\n")
            self.jsonl.flush()
        return values

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
