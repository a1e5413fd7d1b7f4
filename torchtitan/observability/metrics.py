"""Training metrics: one console line per log step, metrics.jsonl, TensorBoard and W&B scalars, throughput,
MFU against a fixed peak, memory."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import re
import resource
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from torchtitan.config.job_config import JobConfig
from torchtitan.observability.goodput import Goodput
from torchtitan.observability.metric_files import JsonlFile, TensorBoardFile

if TYPE_CHECKING:
    from torchtitan.observability.stragglers import SlowLink, SlowRank

logger = logging.getLogger(__name__)

# Dense (no 2:4 sparsity) peak TFLOP/s of one device from the vendors' datasheets, as
# (name, bf16/fp16 tensor cores, tf32 tensor cores, fp32 without tensor cores). Matched as whole
# words of the CUDA device name; the first match wins, so a variant ("H100 NVL") precedes its family
# ("H100", the SXM part). Fixed figures keep MFU comparable between runs, machines and stacks.
_GPU_PEAK_TFLOPS = (
    ("H100 NVL", 835, 418, 60),
    ("H100 PCIe", 756, 378, 51),
    ("H100", 989, 495, 67),
    ("H200 NVL", 835, 418, 60),
    ("H200", 989, 495, 67),
    ("GH200", 989, 495, 67),
    ("B200", 2250, 1125, 75),  # HGX B200 figures divided by its 8 GPUs
    ("A100", 312, 156, 19.5),
    ("L40S", 362, 183, 91.6),
    ("L40", 181, 90.5, 90.5),
    ("L4", 121, 60, 30.3),
    ("RTX A6000", 155, 77.4, 38.7),
    ("MI300X", 1307, 654, 163),
    ("MI325X", 1307, 654, 163),
)
CACHE_DIR_ENV = "TORCHTITAN_CACHE_DIR"


def gpu_peak_flops(device_name: str, compute_dtype: torch.dtype, tf32: bool = False) -> float | None:
    """Datasheet peak FLOP/s of a GPU in the dtype its matmuls run in; None for an unknown GPU.

    fp32 matmuls run on the tensor cores at TF32 rate only where PyTorch allows TF32 (`tf32`),
    else at the much lower plain fp32 rate, which is PyTorch's default.
    """
    for key, bf16, tf32_peak, fp32 in _GPU_PEAK_TFLOPS:
        if re.search(rf"\b{re.escape(key)}\b", device_name):
            if compute_dtype in (torch.bfloat16, torch.float16):
                return bf16 * 1e12
            return (tf32_peak if tf32 else fp32) * 1e12
    return None


def _tf32_matmuls() -> bool:
    return getattr(torch.backends.cuda.matmul, "fp32_precision", "none") == "tf32"


def measure_cpu_peak_flops(dtype: torch.dtype = torch.float32, seconds: float = 1.0, n: int = 1024) -> float:
    """Matmul FLOP/s of this process in `dtype` with its current thread count: the best of 8 short
    rounds, since other load on the machine can only slow a round down."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up: thread pool start, kernel selection, caches
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / 8:
            a @ b
            count += 1
        best = max(best, 2 * n**3 * count / elapsed)
    return best


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read_cache(path: str) -> dict[str, float]:
    try:
        with open(path) as f:
            cache = json.load(f)
    except (OSError, ValueError):  # missing or damaged: measured again and rewritten
        return {}
    return {k: v for k, v in cache.items() if isinstance(v, (int, float)) and v > 0} if isinstance(cache, dict) else {}


def cpu_peak_flops(dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """This CPU's matmul peak in `dtype` for this process's thread count, and where it came from.

    CPUs have no datasheet figure that matches what PyTorch reaches, so the peak is measured, but
    once per CPU model, thread count and dtype, and cached in $TORCHTITAN_CACHE_DIR (default
    ~/.cache/torchtitan/cpu_peak_flops.json): every later run divides by the same figure, so MFU
    moves only with the run's own speed. Delete the file to measure again (e.g. after upgrading
    PyTorch, whose kernels set the peak). A figure measured while the machine was busy is too low;
    a run that goes faster raises it (`raise_cpu_peak`).
    """
    key, folder, path = _cpu_cache_entry(dtype)
    try:
        os.makedirs(folder, exist_ok=True)
        lock = open(path + ".lock", "a")
    except OSError as e:
        logger.warning(f"cannot write the CPU peak cache in {folder} ({e.strerror}); set {CACHE_DIR_ENV} to a writable "
                       "folder. Measuring now: this run's MFU is comparable within the run only")
        return measure_cpu_peak_flops(dtype), f"measured now for {key!r}, not cached"
    with lock:
        # The ranks on one machine take turns: the first measures alone and the others read its
        # figure. Ranks measuring at the same time would slow each other down and disagree.
        fcntl.flock(lock, fcntl.LOCK_EX)
        cache = _read_cache(path)
        if key in cache:
            return float(cache[key]), f"measured once for {key!r}, cached in {path}"
        cache[key] = peak = measure_cpu_peak_flops(dtype)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(cache, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    return peak, f"measured now for {key!r}, cached in {path}"


def _cpu_cache_entry(dtype: torch.dtype) -> tuple[str, str, str]:
    key = f"{_cpu_model()} | {torch.get_num_threads()} threads | {str(dtype).removeprefix('torch.')}"
    folder = os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "torchtitan")
    return key, folder, os.path.join(folder, "cpu_peak_flops.json")


def raise_cpu_peak(dtype: torch.dtype, flops: float) -> None:
    """Raises the cached CPU peak to `flops`, what a run reached, when that is higher: the cached
    figure was measured while other work slowed the machine down."""
    key, _, path = _cpu_cache_entry(dtype)
    try:
        with open(path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cache = _read_cache(path)
            if flops <= cache.get(key, 0.0):
                return
            cache[key] = flops
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(cache, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
    except OSError:
        pass  # the cache is a convenience: a run never fails over it


def peak_flops(device: torch.device, compute_dtype: torch.dtype, override_tflops: float = 0.0) -> tuple[float, str]:
    """Peak matmul FLOP/s of one device in the dtype the model computes in, and its source."""
    if override_tflops > 0:
        return override_tflops * 1e12, "metrics.peak_tflops"
    if device.type != "cuda":
        return cpu_peak_flops(compute_dtype)
    name = torch.cuda.get_device_name(device)
    tf32 = compute_dtype == torch.float32 and _tf32_matmuls()
    peak = gpu_peak_flops(name, compute_dtype, tf32)
    if peak is None:
        logger.warning(f"unknown GPU {name!r}: MFU is computed against the H100 SXM peak; set metrics.peak_tflops "
                       "to this GPU's dense peak")
        return gpu_peak_flops("H100", compute_dtype, tf32), "H100 SXM datasheet (unknown GPU)"
    return peak, f"datasheet figure for {name}{' with TF32 matmuls' if tf32 else ''}"


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


class _WandbSink:
    """Weights & Biases run of this job (rank 0): the same scalars as TensorBoard, under train/<name>."""

    def __init__(self, job_config: JobConfig):
        import wandb  # optional; config validation refused enable_wandb if it is missing

        folder = job_config.job.dump_folder
        os.makedirs(folder, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "torchtitan"), dir=folder,
                              config=job_config.to_dict())
        logger.info(f"Weights & Biases run files go to {os.path.join(folder, 'wandb')}")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log({f"train/{name}": value for name, value in values.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


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
    # The model's own figures (TrainSpec.after_step_fn): logged under their names; `model_summary`
    # ends the console line.
    model_values: dict[str, float] = field(default_factory=dict)
    model_summary: str = ""
    # Straggler report: (slowest rank, its seconds, the median) of the ranks' own time per step
    # (data loading and optimizer step, trainer/instruments.py); None on one process.
    own_seconds: tuple[int, float, float] | None = None
    # On several nodes: the slowest rank's node and host, and the link probe's slowest node
    # (observability/stragglers.py).
    slowest_where: str = ""
    slow_compute: SlowRank | None = None
    slow_link: SlowLink | None = None
    steps: int = 1  # steps since the last log line
    total_steps: int = 0  # training.steps, for `step: 10/100`; 0 leaves it out
    progress: str = ""  # elapsed and estimated time left (progress.py), ending the console line
    # A mixture of sources: training tokens taken from each so far, all data-parallel ranks together.
    source_tokens: dict[str, float] = field(default_factory=dict)


@dataclass
class LogWindow:
    """What the steps since the last step line did, measured by the training loop."""

    first_step: int
    start: float = field(default_factory=time.perf_counter)
    tokens: int = 0  # of whole sequences, before context parallelism cuts them
    data_seconds: float = 0.0  # waiting for batches
    # Each rank's own time: loading data and the optimizer step, the parts of a step where ranks do
    # not wait for each other, so a slow rank shows as itself rather than in its peers' waits; each
    # log line compares the slowest rank's with the median (straggler report).
    own_seconds: float = 0.0

    def restart(self, first_step: int) -> None:
        self.first_step, self.start = first_step, time.perf_counter()
        self.tokens, self.data_seconds, self.own_seconds = 0, 0.0, 0.0


# A straggler is named on the console when its own time exceeds the median by this share of a step.
STRAGGLER_SHARE = 0.05


class MetricsLogger:
    """Turns step measurements into throughput, MFU and memory figures; prints and records them."""

    def __init__(self, job_config: JobConfig, device: torch.device, flops_per_token: int, rank: int,
                 compute_dtype: torch.dtype = torch.float32, resumed_step: int = 0, goodput: Goodput | None = None):
        self.device = device
        self.goodput = goodput
        self.flops_per_token = flops_per_token
        metrics = job_config.metrics
        self.peak_flops, peak_source = peak_flops(device, compute_dtype, metrics.peak_tflops)
        # A measured CPU peak that a run outpaces was measured on a busy machine (see raise_cpu_peak).
        self._cpu_peak_dtype = compute_dtype if device.type == "cpu" and metrics.peak_tflops <= 0 else None
        self.colors = _Colors(metrics.enable_color_printing and not metrics.disable_color_printing)
        self.writer: TensorBoardFile | None = None
        self.wandb = _WandbSink(job_config) if metrics.enable_wandb and rank == 0 else None
        self.jsonl: JsonlFile | None = None
        if metrics.save_jsonl and rank == 0:
            os.makedirs(job_config.job.dump_folder, exist_ok=True)
            self.jsonl = JsonlFile(os.path.join(job_config.job.dump_folder, "metrics.jsonl"), resumed_step)
        if goodput is not None:  # rank 0 appends this attempt to the job's goodput.jsonl
            goodput.join_job(job_config.job.dump_folder, resumed_step, write=rank == 0)
        if metrics.enable_tensorboard and (rank == 0 or not metrics.rank_0_only):
            folder = os.path.join(job_config.job.dump_folder, metrics.save_tb_folder)
            if not metrics.rank_0_only:
                folder = os.path.join(folder, f"rank_{rank}")
            self.writer = TensorBoardFile(folder)
            logger.info(f"TensorBoard scalars go to {folder}")
        logger.info(f"peak FLOP/s per device for MFU: {self.peak_flops / 1e12:.3f} T ({device.type}, {compute_dtype}; "
                    f"{peak_source})")
        # This run's totals over its logged windows (every step belongs to one), for the summary.
        self.run_tokens, self.run_seconds = 0.0, 0.0
        # The same after this run's first logged window, whose first step pays for compilation and
        # the allocator's warm-up: the steady-state rate (None until a second window).
        self.steady_tokens, self.steady_seconds, self._windows = 0.0, 0.0, 0
        # Validation losses by step: an earlier run's rows kept in metrics.jsonl (a resumed job's),
        # then this run's.
        self.validations: dict[int, float] = dict(self.jsonl.kept_validations) if self.jsonl is not None else {}

    def log(self, s: StepMetrics) -> dict[str, float]:
        tps = s.tokens / s.seconds
        tflops = self.flops_per_token * tps / 1e12
        mfu = 100 * tflops * 1e12 / self.peak_flops
        if mfu > 100 and self._cpu_peak_dtype is not None:
            # Measured again (once, about a second), keeping the higher figure for later runs.
            again = max(measure_cpu_peak_flops(self._cpu_peak_dtype), tflops * 1e12)
            raise_cpu_peak(self._cpu_peak_dtype, again)
            logger.warning(f"this run computes {tflops:.3f} TFLOP/s, above the cached CPU peak "
                           f"({self.peak_flops / 1e12:.3f} T, measured while the machine was busy); measured again: "
                           f"{again / 1e12:.3f} T, which later runs use. This run's MFU stays against the old figure")
            self._cpu_peak_dtype = None  # once per run
        peak_mem, current_mem = memory_gib(self.device)
        values = {
            "loss": s.loss, "grad_norm": s.grad_norm, "lr": s.lr, "tokens_per_second": tps,
            "tflops": tflops, "mfu_percent": mfu, "memory_peak_gib": peak_mem,
            "memory_current_gib": current_mem, "data_loading_percent": 100 * s.data_seconds / s.seconds,
        }
        if s.pp_bubble is not None:
            values["pp_bubble_percent"] = 100 * s.pp_bubble
        if self.goodput is not None:  # this run's so far, on this rank's own clock: no communication
            values["goodput_percent"] = self.goodput.percent()
        values.update(s.model_values)
        values.update({f"data_tokens/{name}": count for name, count in s.source_tokens.items()})
        bubble = f"  bubble: {100 * s.pp_bubble:.1f}%" if s.pp_bubble is not None else ""
        if s.source_tokens:
            total = sum(s.source_tokens.values()) or 1
            bubble += "  mix: " + " ".join(f"{name} {100 * n / total:.0f}%" for name, n in s.source_tokens.items())
        bubble += f"  {s.model_summary}" if s.model_summary else ""
        if s.own_seconds is not None:
            rank, slowest, median = s.own_seconds
            values.update(slowest_rank=rank, slowest_rank_own_seconds=slowest, median_rank_own_seconds=median)
            if slowest - median > STRAGGLER_SHARE * s.seconds / s.steps:
                where = f" ({s.slowest_where})" if s.slowest_where else ""
                bubble += (f"  slowest: rank {rank}{where} {slowest:.3f}s/step vs median {median:.3f}s "
                           f"({slowest / max(median, 1e-9):.1f}x, data + optimizer)")
        if s.slow_compute is not None:
            slow = s.slow_compute
            values.update(slowest_compute_rank=slow.rank, slowest_compute_ms=1e3 * slow.seconds,
                          median_compute_ms=1e3 * slow.median_seconds)
            if slow.stands_out:
                bubble += f"  {slow.text()}"
        if s.slow_link is not None:
            link = s.slow_link
            values.update(slowest_link_node=link.node, slowest_link_ms=1e3 * link.seconds,
                          median_link_ms=1e3 * link.median_seconds)
            # A node that computes slowly also answers the probe late: its link is named only when
            # its compute is not (the compute probe explains the delay).
            slow_there = (s.slow_compute is not None and s.slow_compute.stands_out
                          and s.slow_compute.where.startswith(f"node {link.node},"))
            if link.stands_out and not slow_there:
                bubble += f"  {link.text()}"
        c = self.colors
        logger.info(
            f"{c.red}step: {s.step:2}{f'/{s.total_steps}' if s.total_steps else ''}  {c.green}loss: {s.loss:7.4f}  {c.reset}grad_norm: {s.grad_norm:7.4f}  "
            f"lr: {s.lr:.2e}  {c.yellow}memory: {peak_mem:5.2f}GiB peak  "
            f"{c.blue}tps: {tps:,.0f}  {c.cyan}tflops: {tflops:,.3f}  {c.magenta}mfu: {mfu:.2f}%  "
            f"{c.reset}data: {values['data_loading_percent']:.1f}%{bubble}"
            + (f"  {s.progress}" if s.progress else "")
        )
        self.run_tokens += s.tokens
        self.run_seconds += s.seconds
        if self._windows:
            self.steady_tokens += s.tokens
            self.steady_seconds += s.seconds
        self._windows += 1
        if self.writer is not None:
            self.writer.add_scalars({f"train/{name}": value for name, value in values.items()}, s.step)
        if self.wandb is not None:
            self.wandb.log(values, s.step)
        if self.jsonl is not None:
            # The wall time (Unix seconds) the row was written: gaps between steps, across processes.
            self.jsonl.write({"step": s.step, "time": round(time.time(), 3), **values}, s.step)
        return values

    def log_validation(self, step: int, loss: float, perplexity: float, batches: int, tokens: int,
                       seconds: float) -> None:
        """One validation run: a console line, TensorBoard / W&B scalars under validation/, and a
        {"record": "validation", ...} row in metrics.jsonl."""
        best_step = min(self.validations, key=self.validations.get, default=None)
        self.validations[step] = loss
        best = "" if best_step is None or loss <= self.validations[best_step] else \
            f"  (best {self.validations[best_step]:.4f} at step {best_step})"
        c = self.colors
        logger.info(f"{c.red}validation at step {step}: {c.green}loss: {loss:7.4f}  {c.reset}perplexity: "
                    f"{perplexity:,.2f}  {batches} batches, {tokens:,} tokens in {seconds:.1f}s{best}")
        values = {"loss": loss, "perplexity": perplexity}
        if self.writer is not None:
            self.writer.add_scalars({f"validation/{name}": value for name, value in values.items()}, step)
        if self.wandb is not None:
            self.wandb.run.log({f"validation/{name}": value for name, value in values.items()}, step=step)
        self.log_record({"record": "validation", "step": step, **values, "batches": batches, "tokens": tokens,
                         "seconds": seconds})

    def mean_throughput(self) -> tuple[float, float]:
        """(tokens/s per device, MFU %) over every step this run logged."""
        return self._rate(self.run_tokens, self.run_seconds) or (0.0, 0.0)

    def steady_throughput(self) -> tuple[float, float] | None:
        """(tokens/s per device, MFU %) over the steps after this run's first step line (the
        steady state, without the first step's compilation); None with a single step line."""
        return self._rate(self.steady_tokens, self.steady_seconds)

    def _rate(self, tokens: float, seconds: float) -> tuple[float, float] | None:
        if seconds <= 0:
            return None
        tps = tokens / seconds
        return tps, 100 * self.flops_per_token * tps / self.peak_flops

    def log_record(self, record: dict) -> None:
        """Appends a record that is not a step's row to metrics.jsonl; its "record" key names its
        kind (the setup record, setup_record.py). Step rows have no such key."""
        if self.jsonl is not None:
            self.jsonl.write(record, record.get("step", record.get("last_step", record.get("first_step"))))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.close()
        if self.jsonl is not None:
            self.jsonl.close()
