#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""One command that checks this stack on a GPU machine and writes what it found as a JSON report.

    scripts/gpu_check.sh [--out gpu_check.json] [--seq-len 4096] [--budget-seconds 420] [--dry]

Checks, in the order they run (docs/gpu_check.md says what each figure means):
  device           GPU name, count, memory, compute capability; driver, CUDA, cuDNN, NCCL, torch,
                   torchao and Python versions.
  sdpa_exactness   the fused SDPA kernels (flash in bf16, memory-efficient in fp32) against the math
                   kernel, forward and backward, each against an fp64 reference.
  ring_attention_kernels  `check_block_kernels` of parallelisms/attention_blocks.py (CP's block kernels, masked too).
  activation_offload  the debug model's loss and gradients with every block's saved activations in
                   (pinned) host memory against without: bitwise; the bytes moved, the copies pinned.
  train_1b, train_3b      bf16 + torch.compile training of Llama 3.2 1B and 3B through the real
                   trainer (torchtitan.tools.runs.run_trainer): tokens/s, MFU, peak memory from its
                   metrics.jsonl. A model that the stack's dry run says does not fit runs with
                   selective activation checkpointing, then with fewer layers, and says so.
  memory_snapshot  profiling.enable_memory_snapshot on a short 1B run: the snapshot file.
  float8_3b        the 3B run again with float8.enable_float8_linear (compute capability >= 8.9 and
                   torchao), and its tokens/s against bf16.

Every trainer run has a timeout inside --budget-seconds (default 420, which leaves a timed-out run
its minute to stop within 8 minutes); a timeout is a failure. The exit status is 1 if any check failed, 0 otherwise; the report
is written either way (--out; default $OUT/gpu_check.json where $OUT is set, else ./gpu_check.json).
`--dry` runs the same path on CPU with tiny stand-ins (debug models, seq 256, 3 steps, fp32, no
compile; float8 and the snapshot recorded as skipped), for CI.

The GPU machine has no package registry. What this project imports beyond a stock PyTorch 2.11
image is torchdata (and torchao, for float8); tiktoken, sentencepiece, regex and tensorboard are
usually there, tomli only matters below Python 3.11. Fetch them on a machine with a registry:
    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d wheels torchdata==0.11.0 torchao==0.18.0
and install them there before this check:
    python3 -m pip install --no-index --no-deps --target /tmp/site wheels/*.whl && export PYTHONPATH=/tmp/site
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # the checkout's torchtitan, also where it is not installed

from torchtitan.tools.runs import read_metrics, read_setup, run_trainer  # noqa: E402 - after the path above

GiB = 2**30
SCHEMA_VERSION = 1
LLAMA3_VOCAB = 128_256
STATUSES = ("ok", "failed", "timeout", "skipped")
CHECKS = ("sdpa_exactness", "ring_attention_kernels", "activation_offload", "optimizers", "train_1b", "memory_snapshot",
          "train_3b", "float8_3b")
# Room the dry run does not see: the CUDA context, cuBLAS workspaces, compile's buffers, the
# caching allocator's fragmentation.
MEMORY_USABLE_FRACTION, MEMORY_RESERVE = 0.9, 1 * GiB


@dataclasses.dataclass(frozen=True)
class Setting:
    """What --dry changes: the real models and sizes, or tiny stand-ins that run on a CPU."""

    flavors: dict[str, str]  # check's model -> flavor trained
    seq_len: int
    batch_tokens: dict[str, int]  # check's model -> tokens per step (batch = this / seq_len, at least 1)
    steps: int
    left_out: int  # first steps not averaged (compile, allocator warm-up)
    compile: bool
    dtype: str  # training.mixed_precision_param asked for
    pad_vocab: bool  # pad the bundled tokenizer's vocabulary to Llama 3's
    budget_seconds: float
    caps: dict[str, float]  # longest timeout per trainer run
    min_seconds: dict[str, float]  # least time a run needs: it is not started with less of the budget left


# 1B: two sequences of 4096 (or one of 8192) fill an 80 GB GPU without activation checkpointing;
# 3B: one sequence.
REAL = Setting({"1B": "1B", "3B": "3B"}, 4096, {"1B": 8192, "3B": 4096}, 15, 5, True, "bfloat16", True, 420,
               {"train_1b": 150, "memory_snapshot": 75, "train_3b": 150, "float8_3b": 150},
               {"train": 60, "snapshot": 40})
DRY = Setting({"1B": "debugmodel", "3B": "debugmodel_tied"}, 256, {"1B": 512, "3B": 512}, 3, 1, False, "float32",
              False, 150, {"train_1b": 60, "memory_snapshot": 40, "train_3b": 60, "float8_3b": 60},
              {"train": 15, "snapshot": 10})


# ---------------------------------------------------------------------------------------------
# Child processes: the device probe and the memory estimate run apart from this orchestrator, so
# that it never holds a CUDA context (memory) while the trainer runs.


def probe(dry: bool) -> dict[str, Any]:
    """Device, versions and the attention exactness checks, measured in this (child) process."""
    import torch

    from torchtitan.observability.metrics import gpu_peak_flops

    device = {"python": platform.python_version(), "torch": torch.__version__, "torchao": _version("torchao"),
              "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        peak = gpu_peak_flops(props.name, torch.bfloat16)
        device.update(name=props.name, count=torch.cuda.device_count(), memory_bytes=props.total_memory,
                      memory_gib=round(props.total_memory / GiB, 2), compute_capability=list(torch.cuda.get_device_capability(0)),
                      multiprocessors=props.multi_processor_count, driver=_driver_version(), cuda=torch.version.cuda,
                      cudnn=torch.backends.cudnn.version(), nccl=_nccl_version(),
                      bf16_peak_tflops=None if peak is None else peak / 1e12)
    else:
        memory = _host_memory_bytes()
        device.update(name=f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)", count=0,
                      memory_bytes=memory, memory_gib=round(memory / GiB, 2), compute_capability=None,
                      multiprocessors=None, driver=None, cuda=None, cudnn=None, nccl=None, bf16_peak_tflops=None)
    checks = {"sdpa_exactness": _timed(lambda: sdpa_exactness(dry)),
              "ring_attention_kernels": _timed(lambda: ring_kernels(dry)),
              "activation_offload": _timed(lambda: activation_offload(dry)),
              "optimizers": _timed(lambda: optimizers(dry))}
    return {"device": device, "checks": checks}


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _nccl_version() -> str | None:
    import torch

    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _timed(check) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        result = check()
    except Exception as e:  # noqa: BLE001 - a broken check is a failed check, and the others still run
        result = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def sdpa_exactness(dry: bool) -> dict[str, Any]:
    """Each fused SDPA kernel and the math kernel in the same dtype against math in fp64 on the same
    (rounded) inputs, causal, forward and backward. Errors are the largest absolute difference of
    out, dq, dk and dv, each relative to the reference's largest magnitude (at least 1). A fused
    kernel passes within twice the math kernel's error in its dtype (no less exact than PyTorch's
    reference path) or within the dtype's floor (a few units in the last place)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    # (name, fused backend, dtype, error floor): flash has no fp32 kernel on CUDA; on the CPU flash is fp32.
    cases = [("flash_bf16", SDPBackend.FLASH_ATTENTION, torch.bfloat16, 3e-2),
             ("efficient_fp32", SDPBackend.EFFICIENT_ATTENTION, torch.float32, 1e-5)] if cuda else \
            [("cpu_flash_fp32", SDPBackend.FLASH_ATTENTION, torch.float32, 1e-5)]
    batch, heads, seq, dim = (2, 16, 2048, 128) if cuda else (1, 4, 256, 64)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(batch, heads, seq, dim, generator=gen, dtype=torch.float64) for _ in range(4)]

    def run(backend, dtype, tensors):
        q, k, v = (t.to(device, dtype, copy=True).requires_grad_() for t in tensors[:3])
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(tensors[3].to(device, dtype))
        return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}

    results, ok = {}, True
    for name, backend, dtype, floor in cases:
        rounded = [t.to(dtype).double() for t in inputs]
        reference = run(SDPBackend.MATH, torch.float64, rounded)
        errors = {}
        for which, kernel in (("fused", backend), ("math", SDPBackend.MATH)):
            got = run(kernel, dtype, rounded)
            errors[which] = max(((got[key].double() - ref).abs().max() / ref.abs().max().clamp(min=1)).item()
                                for key, ref in reference.items())
        tolerance = max(2 * errors["math"], floor)
        passed = errors["fused"] <= tolerance
        ok &= passed
        results[name] = {"dtype": str(dtype).removeprefix("torch."), "max_error": errors["fused"],
                         "math_max_error": errors["math"], "tolerance": tolerance, "ok": passed}
    if cuda:  # the model's own call: grouped-query attention through enable_gqa, which must still take flash
        q = inputs[0].to(device, torch.bfloat16)
        kv = inputs[1][:, : heads // 4].to(device, torch.bfloat16)
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
            results["flash_gqa_bf16"] = "runs"
        except RuntimeError as e:
            ok, results["flash_gqa_bf16"] = False, f"refused: {str(e).splitlines()[0]}"
    return {"status": "ok" if ok else "failed", "reason": None if ok else "a fused kernel is outside its tolerance",
            "shape": [batch, heads, seq, dim], "device": device, "cases": results}


def ring_kernels(dry: bool) -> dict[str, Any]:
    import torch

    from torchtitan.parallelisms import attention_blocks

    check = getattr(attention_blocks, "check_block_kernels", None)
    if check is None:
        return {"status": "skipped", "reason": "not available: parallelisms/attention_blocks.py has no check_block_kernels"}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtypes = [torch.bfloat16, torch.float32] if device == "cuda" else [torch.float32]
    results = {str(d).removeprefix("torch."): check(device, d) for d in dtypes}
    ok = all(r.get("ok", True) for r in results.values())
    return {"status": "ok" if ok else "failed", "reason": None if ok else "a block kernel is outside its tolerance",
            "device": device, "results": results}


def activation_offload(dry: bool) -> dict[str, Any]:
    """The Llama 3 debug model (fp32, seq 512, batch 2) on the device, its loss and gradients with
    activation_checkpoint.offload all against without; on CUDA the copies must be pinned host
    memory (the side-stream path), and the result bitwise the same."""
    import copy

    import torch
    import torch.nn.functional as F

    from torchtitan.models.llama.flavors import llama3_configs
    from torchtitan.models.llama.model import Transformer
    from torchtitan.parallelisms.activation_offload import apply_offload

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = dataclasses.replace(llama3_configs["debugmodel"], vocab_size=2048)
    torch.manual_seed(0)
    with torch.device(device):
        base = Transformer(args)
        base.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 513), generator=torch.Generator().manual_seed(1)).to(device)

    def step(model) -> tuple[torch.Tensor, list[torch.Tensor], float]:
        start = time.perf_counter()
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return loss.detach(), [p.grad for p in model.parameters()], time.perf_counter() - start

    plain_loss, plain_grads, plain_s = step(copy.deepcopy(base))
    model = copy.deepcopy(base)
    stats = apply_offload(model, "all")
    pinned = []
    for block in model.layers.values():
        pack = block.offloader.pack

        def recording(t, pack=pack):
            packed = pack(t)
            if packed is not t:
                pinned.append(packed.packed.host.is_pinned())
            return packed

        block.offloader.pack = recording
    loss, grads, offload_s = step(model)
    bitwise = bool(torch.equal(loss, plain_loss)) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    ok = bitwise and stats.tensors > 0 and (device.type != "cuda" or (bool(pinned) and all(pinned)))
    return {"status": "ok" if ok else "failed", "reason": None if ok else "offloaded step differs or was not pinned",
            "device": str(device), "bitwise": bitwise, "tensors_moved": stats.tensors,
            "mib_moved": round(stats.bytes / 2**20, 1), "pinned": all(pinned) if pinned else None,
            "seconds_plain": round(plain_s, 3), "seconds_offloaded": round(offload_s, 3)}


def optimizers(dry: bool) -> dict[str, Any]:
    """One step of each optimizer the stack offers on a Llama-3-8B-block-shaped set of matrices
    (a 64-wide stand-in with --dry), on the device: fused AdamW, AdamW with bf16 moments (nearest
    and stochastic rounding), Muon with Newton-Schulz in bf16 and in fp32. Milliseconds per step
    (median of 5 after 2 warm-ups) and state bytes; Muon's bf16 orthogonalisation must keep the
    singular values in the published band, and bf16 moments must step within bf16's rounding of
    the fp32 ones."""
    import torch

    from torchtitan.optimizers.low_precision_adamw import LowPrecisionAdam
    from torchtitan.optimizers.muon import Muon, orthogonalize

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dim, hidden = (64, 224) if dry else (4096, 14336)
    shapes = [(dim, dim)] * 2 + [(dim // 4, dim)] * 2 + [(hidden, dim)] * 2 + [(dim, hidden)]  # q o k v, w1 w3 w2
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=gen).div_(s[1] ** 0.5).to(device) for s in shapes]
    grads = [torch.randn(s, generator=gen).mul_(1e-3).to(device) for s in shapes]
    adam = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}  # the stack's defaults, alike for all
    makers = {"adamw_fused": lambda ps: torch.optim.AdamW(ps, fused=True, **adam),
              "adamw_bf16_nearest": lambda ps: LowPrecisionAdam(ps, decoupled_weight_decay=True, **adam),
              "adamw_bf16_stochastic": lambda ps: LowPrecisionAdam(ps, decoupled_weight_decay=True,
                                                                   stochastic_rounding=True, **adam),
              "muon_ns_bf16": lambda ps: Muon(ps, lr=1e-3, weight_decay=0.1, ns_dtype=torch.bfloat16),
              "muon_ns_fp32": lambda ps: Muon(ps, lr=1e-3, weight_decay=0.1, ns_dtype=torch.float32)}
    results, params = {}, {}
    for name, make in makers.items():
        ps = [torch.nn.Parameter(w.clone()) for w in weights]
        optimizer = make(ps)
        times, warm, measured = [], 2, 1 if dry else 5
        for i in range(warm + measured):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warm:
                times.append(time.perf_counter() - start)
        state = sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
                    if torch.is_tensor(t) and t.dim() > 0)
        results[name] = {"ms_per_step": round(1e3 * sorted(times)[len(times) // 2], 3), "state_mib": round(state / 2**20, 2)}
        params[name] = ps
    singular = torch.linalg.svdvals(orthogonalize(grads[4], 5, torch.bfloat16).float())
    band = [round(float(singular.min()), 3), round(float(singular.max()), 3)]
    drift = max(float((a - b).detach().abs().max()) for a, b in zip(params["adamw_bf16_nearest"], params["adamw_fused"]))
    ok = 0.5 <= band[0] and band[1] <= 1.3 and drift < 1e-4
    return {"status": "ok" if ok else "failed",
            "reason": None if ok else f"Muon bf16 singular values {band} or bf16-moment drift {drift:.2e} out of bounds",
            "device": str(device), "matrices": len(shapes), "parameters": sum(w.numel() for w in weights),
            "results": results, "muon_bf16_singular_values": band, "bf16_moments_max_weight_diff": drift}


def estimate(trainer_args: list[str]) -> dict[str, Any]:
    """The stack's dry run of one trainer configuration (fake tensors, no device memory used), with
    the model's sizes the memory planning scales by."""
    from torchtitan.config.manager import parse_args
    from torchtitan.config.preflight import preflight
    from torchtitan.estimation.dry_run import dry_run

    config = parse_args([*trainer_args, "--job.dry_run"])
    start = time.perf_counter()
    result = dry_run(config)
    memory = result.largest.memory
    model = preflight(config, 1, result.device_type, check_memory=False).model  # meta: the run's real vocabulary
    block = next(iter(model.layers.values()))
    training = config.training
    return {"peak_bytes": memory.peak, "at_peak": memory.at_peak, "compute_dtype": result.compute_dtype,
            "n_params": sum(p.numel() for p in model.parameters()), "n_layers": len(model.layers),
            "layer_params": sum(p.numel() for p in block.parameters()), "dim": model.args.dim,
            "tokens": training.batch_size * training.seq_len, "seconds": round(time.perf_counter() - start, 1)}


# ---------------------------------------------------------------------------------------------
# Memory planning from the dry run


@dataclasses.dataclass(frozen=True)
class Plan:
    ac: str  # activation_checkpoint.mode: none or selective (every second block)
    n_layers: int | None  # None: the flavor's own
    estimate_bytes: int | None  # None: no estimate
    note: str = ""


# Without an estimate (the dry run failed): the whole model, then with checkpointing after an
# out-of-memory error.
UNPLANNED = [Plan("none", None, None, "no memory estimate"), Plan("selective", None, None, "no memory estimate")]


def plan_memory(est: dict[str, Any], budget: int) -> list[Plan]:
    """The configurations that fit `budget` bytes by the dry run of the whole model without
    activation checkpointing, best first: that one; selective checkpointing of every second block;
    that with as many layers as fit. The next plan is the one tried after an out-of-memory error."""
    n, peak = est["n_layers"], est["peak_bytes"]
    plans = [Plan("none", n, peak)] if peak <= budget else []
    whole = selective_peak(est, n)
    if whole <= budget:
        plans.append(Plan("selective", n, whole))
    layers = next((k for k in range(n - 1, 0, -1) if selective_peak(est, k) <= budget), 0)
    if layers:
        plans.append(Plan("selective", layers, selective_peak(est, layers),
                          f"{layers} of {n} layers: the whole model is estimated at {whole / GiB:.1f} GiB with "
                          f"selective activation checkpointing, more than the {budget / GiB:.1f} GiB usable here"))
    return plans


def selective_peak(est: dict[str, Any], layers: int) -> int:
    """The dry run's peak without checkpointing (at the start of backward) scaled to selective
    checkpointing of every second block and to `layers` of the model's layers, or the optimizer
    step's peak if that is higher.

    A checkpointed block keeps its fp32 input instead of its activations (which hold the bf16
    copies of its weights), plus one block's activations while it is recomputed; a layer less
    takes away its fp32 weights and Adam moments (12 bytes a parameter; gradients do not exist yet)
    and its activations. The optimizer step holds the fp32 weights, gradients and moments, 16 bytes
    a parameter (the fused Adam kernels, the default, keep no temporaries)."""
    n, act = est["n_layers"], est["at_peak"].get("activations", 0)
    block_input = est["tokens"] * est["dim"] * 4
    fewer = n - layers
    backward = (est["peak_bytes"] - act / 2 + layers / 2 * block_input + act / n
                - fewer * (est["layer_params"] * 12 + act / (2 * n)))
    return int(max(backward, (est["n_params"] - fewer * est["layer_params"]) * 16))


def usable_memory(device: dict[str, Any]) -> int:
    return int(device["memory_bytes"] * MEMORY_USABLE_FRACTION - MEMORY_RESERVE)


# ---------------------------------------------------------------------------------------------
# Trainer runs


class Clock:
    """The check's time budget: each run's timeout leaves the later runs their least time."""

    def __init__(self, budget: float, min_seconds: dict[str, float]):
        self.start, self.budget, self.min_seconds = time.monotonic(), budget, min_seconds

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def timeout(self, cap: float, later: list[str]) -> float:
        return min(cap, self.left() - sum(self.min_seconds[kind] for kind in later))


SETUP_KEYS = ("model", "compile", "activation_checkpoint", "autocast", "fsdp", "float8")
PEAK_LINE = re.compile(r"peak FLOP/s per device for MFU: ([\d.]+) T \((\w+), torch\.(\w+); ([^)]*)\)")


def trainer_args(setting: Setting, flavor: str, batch: int, seq_len: int, dump: Path, plan: Plan | None,
                 dtype: str, compile: bool, steps: int) -> list[str]:
    args = ["--job.config_file", "bundled:train_configs/debug_model.toml", "--job.dump_folder", str(dump),
            "--model.flavor", flavor, "--training.seq_len", str(seq_len), "--training.batch_size", str(batch),
            "--training.steps", str(steps), "--training.warmup_steps", str(min(2, steps)), "--metrics.log_freq", "1",
            "--metrics.disable_color_printing", "--training.mixed_precision_param", dtype]
    if setting.pad_vocab:
        # No Llama 3 tokenizer is available offline: the bundled one's vocabulary is padded to
        # Llama 3's size, so the embedding, output projection and loss have their real cost (the
        # padding rows' logits are masked to -inf).
        args += ["--model.vocab_size_divisible_by", str(LLAMA3_VOCAB)]
    if compile:
        args.append("--training.compile")
    if plan is not None:
        args += ["--activation_checkpoint.mode", plan.ac]
        if plan.ac == "selective":
            args += ["--activation_checkpoint.selective_ac_option", "2"]
    return args


def fewer_layers(work: Path, flavor: str, n_layers: int) -> tuple[str, list[str]]:
    """A flavor with fewer layers, registered by a module the trainer imports
    (experimental.custom_import), and the options that select it."""
    name = f"{flavor}_{n_layers}layers"
    (work / "gpu_check_flavors.py").write_text(
        '"""Written by scripts/gpu_check.py: flavors with fewer layers, for GPUs that cannot hold all of them."""\n'
        "import dataclasses\n\nfrom torchtitan.models.llama.flavors import llama3_configs\n\n"
        f"llama3_configs[{name!r}] = dataclasses.replace(llama3_configs[{flavor!r}], n_layers={n_layers})\n")
    return name, ["--experimental.custom_import", "gpu_check_flavors"]


def train(name: str, args: list[str], timeout: float, work: Path, left_out: int, bf16_peak_tflops: float | None,
          extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """One trainer run; the averages of its metrics.jsonl after the first `left_out` steps."""
    if timeout < 10:
        return {"status": "timeout", "reason": "not started: the time budget was spent", "seconds": 0.0}
    dump = Path(args[args.index("--job.dump_folder") + 1])
    env = {"OMP_NUM_THREADS": str(min(8, os.cpu_count() or 1)), "PYTHONPATH": os.pathsep.join(
        [str(work), *filter(None, [os.environ.get("PYTHONPATH")])]), **(extra_env or {})}
    start = time.perf_counter()
    out: dict[str, Any] = {"command": "python -m torchtitan.train " + " ".join(args), "timeout_seconds": round(timeout)}
    try:
        result = run_trainer(args, timeout=timeout, check=False, extra_env=env, cwd=REPO_ROOT)
        text, code = result.stdout + result.stderr, result.returncode
    except subprocess.TimeoutExpired as e:
        text, code = _text(e.stdout) + _text(e.stderr), None
    out["seconds"] = round(time.perf_counter() - start, 1)
    (work / f"{name}.log").write_text(text)
    out["log"] = str(work / f"{name}.log")
    rows = read_metrics(dump) if (dump / "metrics.jsonl").exists() else []
    rows = [r for r in rows if "tokens_per_second" in r]  # not the run's summary row
    setup = read_setup(dump) if rows else None
    if setup is not None:  # what the run applied, as the trainer describes it (setup_record.py)
        out["applied"] = {key: setup.get(key) for key in SETUP_KEYS}
    out.update(figures(rows, left_out, bf16_peak_tflops))
    peak = PEAK_LINE.search(text)
    if peak:
        out.update(compute_dtype=peak.group(3), trainer_peak_tflops=float(peak.group(1)), peak_source=peak.group(4))
    if code is None:
        out.update(status="timeout", reason=f"stopped after {timeout:.0f}s", log_tail=text[-2000:])
    elif code != 0:
        out.update(status="failed", reason=_last_line(text, code), log_tail=text[-2000:],
                   out_of_memory="out of memory" in text.lower() or "OutOfMemoryError" in text)
    elif not rows:
        out.update(status="failed", reason="the run logged no step to metrics.jsonl", log_tail=text[-2000:])
    else:
        out.update(status="ok", reason=None)
    return out


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _last_line(text: str, code: int) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return f"exit code {code}: {lines[-1] if lines else 'no output'}"


def figures(rows: list[dict], left_out: int, bf16_peak_tflops: float | None) -> dict[str, Any]:
    """Means over the steps after the first `left_out` (all of them if that leaves none)."""
    if not rows:
        return {"steps_logged": 0}
    kept = rows[left_out:] or rows
    tflops = statistics.mean(r["tflops"] for r in kept)
    return {"steps_logged": len(rows), "steps_averaged": len(kept),
            "tokens_per_second": statistics.mean(r["tokens_per_second"] for r in kept),
            "tokens_per_second_stdev": statistics.pstdev(r["tokens_per_second"] for r in kept),
            "tflops": tflops, "mfu_percent": statistics.mean(r["mfu_percent"] for r in kept),
            "mfu_percent_of_bf16_peak": None if not bf16_peak_tflops else 100 * tflops / bf16_peak_tflops,
            "memory_peak_gib": max(r["memory_peak_gib"] for r in rows),
            "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"]}


def dtype_to_ask(setting: Setting) -> tuple[str, str | None]:
    """training.mixed_precision_param to pass: bf16 where the config checks of one rank accept it,
    else `auto` (bf16 on CUDA wherever the stack computes in it), with the refusal as a note."""
    from torchtitan.config.manager import parse_args, validate_world_size
    from torchtitan.errors import ConfigError

    if setting.dtype != "bfloat16":
        return setting.dtype, None
    try:
        validate_world_size(parse_args(["--training.mixed_precision_param", "bfloat16"]), 1)
    except ConfigError as e:
        return "auto", f"training.mixed_precision_param bfloat16 is refused on one GPU ({e}); ran with auto"
    return "bfloat16", None


def batch_size(setting: Setting, model: str, seq_len: int) -> int:
    return max(1, setting.batch_tokens[model] // seq_len)


# The runs after each one, whose least time its timeout leaves.
LATER = {"train_1b": ["snapshot", "train", "train"], "memory_snapshot": ["train", "train"], "train_3b": ["train"],
         "float8_3b": []}


@dataclasses.dataclass
class Runs:
    """The trainer runs of one check, with the memory plans of each model."""

    setting: Setting
    work: Path
    seq_len: int
    dtype: str
    clock: Clock
    budget: int  # usable device memory, bytes
    plans: dict[str, tuple[dict | None, list[Plan], str | None]]  # model -> (estimate, plans, estimate error)
    bf16_peak_tflops: float | None

    def train(self, check: str, model: str, extra: list[str] = (), like: dict[str, Any] | None = None) -> dict[str, Any]:
        """Trains `model` by the first of its plans that does not run out of memory; `like`: as that
        earlier run of the same model did (the float8 run: with no other plan, what is compared must match)."""
        s, est = self.setting, self.plans[model][0]
        model_plans, estimate_error = self.plans[model][1:]
        if not model_plans:
            return {"status": "failed", "reason": f"does not fit in {self.budget / GiB:.1f} GiB even with one layer",
                    "seconds": 0.0, "estimated_peak_gib": round(est["peak_bytes"] / GiB, 2)}
        first = (like or {}).get("plan_used", 1) - 1
        model_plans = model_plans[first:][:1 if check == "float8_3b" else None]
        for index, plan in enumerate(model_plans, start=first):
            flavor, custom = s.flavors[model], []
            if plan.n_layers is not None and plan.n_layers < est["n_layers"]:
                flavor, custom = fewer_layers(self.work, flavor, plan.n_layers)
            steps = 2 if check == "memory_snapshot" else s.steps
            args = trainer_args(s, flavor, batch_size(s, model, self.seq_len), self.seq_len, self.work / check, plan,
                                self.dtype, s.compile and check != "memory_snapshot", steps) + custom + list(extra)
            result = train(check, args, self.clock.timeout(s.caps[check], LATER[check]), self.work, s.left_out,
                           self.bf16_peak_tflops)
            result.update(flavor=flavor, stand_in_for=model if s is DRY else None,
                          n_layers=plan.n_layers or (est or {}).get("n_layers"),
                          n_layers_of_flavor=(est or {}).get("n_layers"), layers_note=plan.note or None,
                          activation_checkpoint=plan.ac + (" (every 2nd block)" if plan.ac == "selective" else ""),
                          seq_len=self.seq_len, batch_size=batch_size(s, model, self.seq_len),
                          compile="--training.compile" in args, plan_used=index + 1,
                          estimated_peak_gib=None if plan.estimate_bytes is None else round(plan.estimate_bytes / GiB, 2),
                          estimate_seconds=(est or {}).get("seconds"), estimate_error=estimate_error)
            # Out of memory although the estimate fitted: the next plan, while there is one and time for it.
            if (result["status"] != "failed" or not result.get("out_of_memory")
                    or self.clock.timeout(s.caps[check], LATER[check]) < s.min_seconds["train"]):
                return result
        return result


# ---------------------------------------------------------------------------------------------
# The check


def start_child(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": str(min(4, os.cpu_count() or 1))})


def child_result(proc: subprocess.Popen, path: Path, timeout: float) -> tuple[dict | None, str]:
    timeout = max(1.0, timeout)  # what is left of the budget, but a second at least
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        return None, f"timed out after {timeout:.0f}s: {output[-1500:]}"
    if proc.returncode != 0 or not path.exists():
        return None, f"exit code {proc.returncode}: {output[-1500:]}"
    return json.loads(path.read_text()), output


def run_check(setting: Setting, seq_len: int, work: Path, report: dict[str, Any], clock: Clock) -> None:
    checks = report["checks"]
    probe_out = work / "probe.json"
    prober = start_child(["--probe", str(probe_out)] + (["--dry"] if setting is DRY else []))
    dtype, dtype_note = dtype_to_ask(setting)
    estimators = {}
    for model, flavor in setting.flavors.items():
        path = work / f"estimate_{model}.json"
        args = trainer_args(setting, flavor, batch_size(setting, model, seq_len), seq_len, work / f"estimate_{model}",
                            None, dtype, False, setting.steps)
        estimators[model] = (start_child(["--estimate", str(path), "--", *args]), path)

    probed, why = child_result(prober, probe_out, min(120, clock.left()))
    if probed is None:
        raise RuntimeError(f"the device probe failed: {why}")
    device = report["device"] = probed["device"]
    checks.update(probed["checks"])
    if setting is REAL and not device["cuda_available"]:
        raise RuntimeError("this machine has no CUDA GPU; --dry runs the check's CPU stand-ins")
    budget = usable_memory(device)
    report["memory_usable_gib"] = round(budget / GiB, 2)
    plans = {}
    for model, (proc, path) in estimators.items():
        est, why = child_result(proc, path, min(150, clock.left()))
        plans[model] = (est, UNPLANNED if est is None else plan_memory(est, budget), None if est else why[-1500:])
    report["vocabulary"] = ("the bundled tokenizer's vocabulary padded to Llama 3's (model.vocab_size_divisible_by "
                            f"{LLAMA3_VOCAB}); the padding rows' logits are masked to -inf" if setting.pad_vocab
                            else "the bundled tokenizer's vocabulary")
    report["dtype_note"] = dtype_note
    runs = Runs(setting, work, seq_len, dtype, clock, budget, plans, device.get("bf16_peak_tflops"))

    checks["train_1b"] = runs.train("train_1b", "1B")
    if not device["cuda_available"]:
        checks["memory_snapshot"] = {"status": "skipped", "seconds": 0.0, "reason": "no CUDA: "
                                     "profiling.enable_memory_snapshot records the CUDA allocator and is refused here"}
    else:
        snap = runs.train("memory_snapshot", "1B", ["--profiling.enable_memory_snapshot", "--profiling.profile_freq", "2"],
                          like=checks["train_1b"])
        file = work / "memory_snapshot" / "memory_snapshot" / "iteration_2" / "rank0_memory_snapshot.pickle"
        snap["snapshot_path"] = str(file) if file.exists() else None
        snap["snapshot_bytes"] = file.stat().st_size if file.exists() else 0
        if snap["status"] == "ok" and not (file.exists() and _starts_as_pickle(file)):
            snap.update(status="failed", reason=f"no pickled snapshot at {file}")
        checks["memory_snapshot"] = snap
    checks["train_3b"] = runs.train("train_3b", "3B")
    checks["float8_3b"] = float8_check(device, checks["train_3b"], runs)


def _starts_as_pickle(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(1) == b"\x80"  # pickle protocol 2 and later


def float8_check(device: dict[str, Any], bf16: dict[str, Any], runs: Runs) -> dict[str, Any]:
    if not device["cuda_available"]:
        return {"status": "skipped", "seconds": 0.0, "reason": "no CUDA: float8 needs a GPU with float8 units"}
    if tuple(device["compute_capability"]) < (8, 9):
        return {"status": "skipped", "seconds": 0.0, "reason": f"compute capability {device['compute_capability']} "
                "has no float8 units (8.9 or newer)"}
    if device["torchao"] is None:
        return {"status": "skipped", "seconds": 0.0, "reason": "skipped: torchao not installed (docs/gpu_check.md)"}
    if bf16["status"] != "ok":
        return {"status": "skipped", "seconds": 0.0, "reason": "the bf16 3B run it is compared with did not succeed"}
    result = runs.train("float8_3b", "3B", ["--float8.enable_float8_linear"], like=bf16)
    if result.get("tokens_per_second") and bf16.get("tokens_per_second"):
        result["speedup_vs_bf16"] = result["tokens_per_second"] / bf16["tokens_per_second"]
    return result


def summary(report: dict[str, Any]) -> list[str]:
    d = report.get("device", {})
    lines = [f"gpu_check{' --dry' if report['dry'] else ''}: {'all checks passed' if report['ok'] else 'FAILED'} "
             f"in {report['seconds']:.0f}s; report {report['out']}"]
    if d:
        count = f" x{d['count']}" if d.get("count") else ""
        lines.append(f"device: {d.get('name')}{count}, {d.get('memory_gib')} GiB, compute capability "
                     f"{d.get('compute_capability')}, driver {d.get('driver')}, CUDA {d.get('cuda')}, cuDNN {d.get('cudnn')}, "
                     f"NCCL {d.get('nccl')}; torch {d.get('torch')}, torchao {d.get('torchao') or 'absent'}, "
                     f"Python {d.get('python')}")
    for name in CHECKS:
        c = report["checks"].get(name)
        if c is None:
            lines.append(f"  {name:24} not run")
            continue
        text = f"  {name:24} {c['status']:8}"
        if "tokens_per_second" in c:
            mfu = c.get("mfu_percent_of_bf16_peak")
            text += (f" {c.get('flavor')} ({c.get('n_layers')} layers, AC {c.get('activation_checkpoint')}, "
                     f"{c.get('compute_dtype', '?')}): {c['tokens_per_second']:,.0f} tokens/s, MFU "
                     f"{c['mfu_percent']:.1f}%" + (f" ({mfu:.1f}% of bf16 peak)" if mfu is not None else "")
                     + f", peak {c['memory_peak_gib']:.1f} GiB (estimated {c.get('estimated_peak_gib')})")
        if "speedup_vs_bf16" in c:
            text += f", {c['speedup_vs_bf16']:.2f}x bf16"
        if c.get("snapshot_path"):
            text += f" {c['snapshot_path']} ({c['snapshot_bytes'] / 2**20:.1f} MiB)"
        if "results" in c:
            text += " " + ", ".join(f"{dtype} {r.get('kernel')} {r.get('max_error', float('nan')):.2e} "
                                    f"(tol {r.get('tolerance', float('nan')):.1e})" for dtype, r in c["results"].items())
        if "cases" in c:
            text += " " + ", ".join(f"{k} {v['max_error']:.2e} (tol {v['tolerance']:.1e})"
                                    for k, v in c["cases"].items() if isinstance(v, dict))
        if c.get("reason"):
            text += f" - {c['reason']}"
        lines.append(text)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="report path (default: $OUT/gpu_check.json if $OUT is set, else ./gpu_check.json)")
    parser.add_argument("--seq-len", type=int, default=None, help="4096 to 8192 (default 4096; --dry: 256)")
    parser.add_argument("--budget-seconds", type=float, default=None, help="time for the whole check (default 420; --dry: 150)")
    parser.add_argument("--work-dir", help="where runs write (default: a new temporary folder, kept)")
    parser.add_argument("--dry", action="store_true", help="the same path on CPU with tiny stand-ins")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--estimate", help=argparse.SUPPRESS)
    parser.add_argument("trainer_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        Path(args.probe).write_text(json.dumps(probe(args.dry), indent=1))
        return 0
    if args.estimate:
        Path(args.estimate).write_text(json.dumps(estimate(args.trainer_args), indent=1))
        return 0
    setting = DRY if args.dry else REAL
    seq_len = args.seq_len or setting.seq_len
    if not args.dry and not 4096 <= seq_len <= 8192:
        parser.error("--seq-len must lie in 4096..8192")
    default_out = Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else Path("gpu_check.json")
    out = Path(args.out) if args.out else default_out
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    clock = Clock(args.budget_seconds or setting.budget_seconds, setting.min_seconds)
    report: dict[str, Any] = {"schema": SCHEMA_VERSION, "dry": args.dry, "out": str(out), "work_dir": str(work),
                              "seq_len": seq_len, "steps": setting.steps, "steps_left_out": setting.left_out,
                              "budget_seconds": clock.budget, "device": {}, "checks": {}, "error": None}
    try:
        run_check(setting, seq_len, work, report, clock)
    except Exception as e:  # noqa: BLE001 - the report is written whatever broke
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        close_report(report, CHECKS, clock, out)
    return print_report(report, summary(report))


def close_report(report: dict[str, Any], names: Sequence[str], clock: Clock, out: Path) -> None:
    """Every check named (`failed` where an earlier error stopped it), the time, the verdict; written."""
    for name in names:
        report["checks"].setdefault(name, {"status": "failed", "reason": "not run (an earlier error)", "seconds": 0.0})
    report["seconds"] = round(time.monotonic() - clock.start, 1)
    report["ok"] = report["error"] is None and all(c["status"] in ("ok", "skipped") for c in report["checks"].values())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))


def print_report(report: dict[str, Any], lines: list[str]) -> int:
    """The summary on stdout, the error on stderr; the exit status."""
    print("\n".join(lines))
    if report["error"]:
        print(f"error: {report['error']}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
