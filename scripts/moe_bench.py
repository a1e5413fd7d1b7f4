#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""MoE benchmarks: the grouped expert matmul (`torch._grouped_mm`) against the per-expert loop.

    .venv/bin/python scripts/moe_bench.py [--devices cpu cuda] [--tokens N] [--reps 3] [--warmup 0]

Section "ep": trains debugmodel_moe with the real trainer at expert-parallel degree 1, 2 and 4 (as
many ranks; --ep-degrees), and reports tokens/s per rank and, from a profiler trace of one step on
every rank, the share of the step spent in the all-to-alls (the functional collectives and their
waits). About two minutes on 2 cores.

Section "grouped_mm": forward + backward (input and weight gradients) of one layer's stacked SwiGLU
experts (`torchtitan.models.moe.GroupedExperts`, three grouped matmuls) on tokens already sorted by
expert, once with `torch._grouped_mm` and once with the exact fallback (one matmul per expert), for:

- debugmodel_moe: dim 256, expert hidden 256, 8 experts, top-2, 4096 tokens (8k token-choices);
- 30B-A3B-like: dim 2048, expert hidden 768, 128 experts, top-8; 4096 tokens on CUDA, 512 on CPU by
  default (--tokens sets both). Its weights and their gradients take 4.5 GiB in fp32, and a pass
  about 2 s of an idle 2-core CPU at 512 tokens (the weights' memory traffic dominates there).

fp32 on CPU (the CPU grouped kernel's dtype), bf16 on CUDA (grouped from compute capability 9.0).
Each expert's share of the tokens comes from the top-k of random router scores (about balanced,
as a trained router aims for). Reported: median milliseconds of --reps passes after an untimed one
(and --warmup more), the speed-up of grouped over the loop, and the largest difference between the
two paths' outputs and gradients (0 in fp32 on CPU, where both compute the same products).

Section "capacity": the dropping mode (`--moe.capacity_factor`, default 1.25 here; --capacity-factor)
against dropless routing. (1) One debugmodel_moe-shaped MoE layer in this process (dim 256, 8
experts, top-2, 8 sequences of 512 tokens), forward + backward, median of --reps: the whole layer,
and the dispatch alone (routing, sorting, the buffer and the combine, with the experts replaced by
an identity), plus the share of token choices dropped. (2) debugmodel_moe trained with the real
trainer at EP 2 on 2 ranks, dropless and dropping: step time and the all-to-all share, as the "ep"
section measures them. About a minute and a half on 2 cores.

Section "deepseek": DeepSeek-V3's debugmodel (train_configs/deepseek_v3_debug.toml) trained under each
of its layouts (one process, FSDP, EP with and without the dropping mode, TP, PP with MTP on the last
stage, CP, EP x TP): tokens/s per rank, step time, the all-to-all share. About five minutes on 2 cores.

The default run takes about 65 CPU-seconds (about half a minute of an idle 2-core CPU; on a
shared machine the figures move with the other processes' load). Each section is one function taking
the parsed arguments and printing its table (`SECTIONS`); further sections plug in there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from torchtitan.models.moe import GroupedExperts, MoE, grouped_mm_supported
from torchtitan.tools.runs import read_metrics, run_trainer


@dataclass(frozen=True)
class ExpertShape:
    name: str
    dim: int
    hidden: int
    experts: int
    top_k: int
    tokens: int

    @property
    def choices(self) -> int:
        return self.tokens * self.top_k


DEBUGMODEL_MOE = ExpertShape("debugmodel_moe", dim=256, hidden=256, experts=8, top_k=2, tokens=4096)
QWEN3_30B_A3B = ExpertShape("30B-A3B-like", dim=2048, hidden=768, experts=128, top_k=8, tokens=4096)
DEFAULT_SHAPES = {
    "cpu": (DEBUGMODEL_MOE, replace(QWEN3_30B_A3B, tokens=512)),
    "cuda": (DEBUGMODEL_MOE, QWEN3_30B_A3B),
}
DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}


# ---------------------------------------------------------------------------------------------
# Section "grouped_mm"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fns: dict, device: torch.device, reps: int, warmup: int) -> dict:
    """Median milliseconds of each function over `reps` rounds, after `warmup` untimed ones. The
    functions take turns within a round, so that load from other processes (a shared machine)
    falls on them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_grouped_mm(shapes, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                     reps: int = 3, warmup: int = 0, seed: int = 0) -> list[dict]:
    """Times forward + backward of each shape's experts, grouped and looped; one dict per shape.

    Each path first makes one untimed pass (then `warmup` more) whose results are compared:
    `max_diff` is the largest difference between the two paths' outputs, input gradients and the
    first two experts' weight gradients. `grouped_ms` is None where `torch._grouped_mm` cannot
    run these operands (`grouped_mm_supported`)."""
    device = torch.device(device)
    dtype = dtype or DTYPES[device.type]
    return [_bench_shape(shape, device, dtype, reps, warmup, seed) for shape in shapes]


def _bench_shape(shape: ExpertShape, device: torch.device, dtype: torch.dtype, reps: int, warmup: int,
                 seed: int) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    experts = GroupedExperts(shape.dim, shape.hidden, shape.experts)
    with torch.no_grad():
        for w in (experts.w1, experts.w2, experts.w3):
            w.normal_(0.0, w.shape[-1] ** -0.5, generator=gen)
    experts = experts.to(device=device, dtype=dtype)
    chosen = torch.topk(torch.randn(shape.tokens, shape.experts, generator=gen), shape.top_k).indices
    counts = torch.bincount(chosen.flatten(), minlength=shape.experts).to(device)
    x = torch.randn(shape.choices, shape.dim, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    grad = torch.randn(shape.choices, shape.dim, generator=gen).to(device=device, dtype=dtype)

    def run(use_grouped_mm: bool | None) -> torch.Tensor:
        experts.use_grouped_mm = use_grouped_mm
        experts.zero_grad(set_to_none=True)  # as an optimizer step leaves them
        x.grad = None
        out = experts(x, counts)
        out.backward(grad)
        return out

    def check(use_grouped_mm: bool | None) -> list[torch.Tensor]:
        out = run(use_grouped_mm)
        # Not every weight gradient: a second copy would double the 30B-A3B layer's memory.
        return [t.detach().float().clone() for t in
                (out, x.grad, experts.w1.grad[:2], experts.w2.grad[:2], experts.w3.grad[:2])]

    looped = check(False)
    fns = {"loop": lambda: run(False)}
    max_diff = None
    if grouped_mm_supported(x, experts.w1, experts.w2, experts.w3):
        max_diff = max((a - b).abs().max().item() for a, b in zip(check(None), looped))
        fns["grouped"] = lambda: run(None)
    del looped
    ms = _time_ms(fns, device, reps, warmup)
    loop_ms, grouped_ms = ms["loop"], ms.get("grouped")
    return {
        "shape": shape, "device": device.type, "dtype": str(dtype).removeprefix("torch."),
        "loop_ms": loop_ms, "grouped_ms": grouped_ms, "max_diff": max_diff,
        "speedup": loop_ms / grouped_ms if grouped_ms else None,
    }


def format_grouped_mm_table(rows: list[dict]) -> str:
    lines = ["| shape | device | dtype | dim | hidden | experts | top-k | tokens | token-choices "
             "| loop ms | grouped ms | speed-up | max diff |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        s = r["shape"]
        grouped = f"{r['grouped_ms']:.1f}" if r["grouped_ms"] is not None else "n/a"
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "n/a"
        diff = f"{r['max_diff']:.1e}" if r["max_diff"] is not None else "n/a"
        lines.append(f"| {s.name} | {r['device']} | {r['dtype']} | {s.dim} | {s.hidden} | {s.experts} | {s.top_k} "
                     f"| {s.tokens} | {s.choices} | {r['loop_ms']:.1f} | {grouped} | {speedup} | {diff} |")
    return "\n".join(lines)


def grouped_mm_section(args: argparse.Namespace) -> None:
    print("## Grouped expert matmul vs per-expert loop (forward + backward of one layer's experts)")
    print()
    rows = []
    for device in args.devices:
        shapes = DEFAULT_SHAPES[device]
        if args.tokens:
            shapes = tuple(replace(s, tokens=args.tokens) for s in shapes)
        rows += bench_grouped_mm(shapes, device, reps=args.reps, warmup=args.warmup)
    print(format_grouped_mm_table(rows))
    print(f"\n(torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
          + (f", {torch.cuda.get_device_name()}" if "cuda" in args.devices else "") + ")")


# ---------------------------------------------------------------------------------------------
# Training throughput under expert parallelism


# The all-to-all work as the profiler names it: the functional collective (which only enqueues on
# gloo and NCCL) and the waits for it. Every functional-collective wait of an EP-only layout belongs
# to the dispatch and combine, except the one all-reduce of the step's routed-token counts.
_A2A_EVENTS = ("_c10d_functional::all_to_all_single", "_c10d_functional::wait_tensor")


def a2a_seconds(trace_path: Path) -> tuple[float, float]:
    """(seconds in all-to-all ops and their waits, seconds of the profiled step) from one rank's
    chrome trace (torchtitan.observability.profiling), counting top-level CPU ops only."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    a2a = sum(e["dur"] for e in ops if e["name"] in _A2A_EVENTS)
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    step = sum(e["dur"] for e in steps)
    return a2a / 1e6, step / 1e6


def train_ep(args: argparse.Namespace, ep: int, extra: tuple[str, ...] = (), nproc: int | None = None,
             config: str = "qwen3_moe_debug", experts: int = DEBUGMODEL_MOE.experts) -> dict:
    """Trains debugmodel_moe (or `config`'s model) at expert-parallel degree `ep` on `nproc` ranks (ep
    by default; FSDP over the ranks `extra` leaves): tokens/s per rank (mean of the logged steps
    after the first), step seconds, the all-to-all share of one profiled step (mean over ranks) and
    the share of token choices dropped."""
    nproc = nproc or ep
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        overrides = ["--job.config_file", f"bundled:train_configs/{config}.toml",
                     "--training.steps", str(args.ep_steps), "--training.seq_len", str(args.ep_seq_len),
                     "--training.batch_size", str(args.ep_batch), "--training.warmup_steps", "1",
                     "--metrics.log_freq", "1", "--metrics.disable_color_printing", "--job.dump_folder", str(folder),
                     "--profiling.enable_profiling", "--profiling.profile_freq", str(args.ep_steps),
                     "--training.expert_parallel_degree", str(ep), *extra]
        run_trainer(overrides, nproc=nproc, timeout=1800)
        steps = read_metrics(folder)[1:]
        tps = statistics.mean(r["tokens_per_second"] for r in steps)
        traces = sorted(folder.glob("profile_traces/iteration_*/rank*_trace.json"))
        shares = [a2a / step for a2a, step in map(a2a_seconds, traces) if step > 0]
        routed = sum(v for r in steps for k, v in r.items() if k.startswith("moe_mean_tokens_per_expert/")) * experts
        dropped = sum(v for r in steps for k, v in r.items() if k.startswith("moe_dropped_tokens/"))
        return {"ep": ep, "ranks": nproc, "tps": tps, "a2a": statistics.mean(shares) if shares and ep > 1 else 0.0,
                "step_s": args.ep_batch * args.ep_seq_len / tps, "dropped": dropped / routed if routed else 0.0}


def ep_section(args: argparse.Namespace) -> None:
    """Trains debugmodel_moe with the real trainer at each expert-parallel degree (EP n on n ranks,
    FSDP over the same ranks), reports tokens/s per rank (mean of the logged steps after the first)
    and, from a profiler trace of one step per rank, the share of step time in the all-to-alls."""
    print(f"## debugmodel_moe under expert parallelism ({args.ep_steps} steps, seq {args.ep_seq_len}, "
          f"{args.ep_batch} sequences per rank)")
    print()
    rows = [train_ep(args, ep) for ep in args.ep_degrees]
    print("| EP | ranks | tokens/s per rank | step s | all-to-all share of step |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['ep']} | {r['ranks']} | {r['tps']:,.0f} | {r['step_s']:.2f} | {100 * r['a2a']:.1f}% |")
    print(f"\n(gloo on {os.cpu_count()} CPU cores, one thread per rank: ranks beyond the core count share cores)")


# ---------------------------------------------------------------------------------------------
# The dropping mode against dropless routing


class _PassThrough(nn.Module):
    """Experts that return their input: what is left of the layer is its dispatch and combine."""

    def forward(self, x: torch.Tensor, counts) -> torch.Tensor:
        return x * 1.0


def bench_capacity_layer(capacity_factor: float, sequences: int = 8, seq_len: int = 512, reps: int = 3,
                         seed: int = 0) -> list[dict]:
    """Forward + backward of one debugmodel_moe-shaped MoE layer, dropless and dropping: median ms
    of the whole layer and of its dispatch alone, and the share of token choices dropped."""
    shape = DEBUGMODEL_MOE
    torch.manual_seed(seed)
    # A shared direction in every token makes the router prefer some experts, as an untrained or
    # drifting router does (a few percent of the choices overflow at factor 1.25).
    x = (torch.randn(sequences, seq_len, shape.dim) + 0.25 * torch.randn(shape.dim)).requires_grad_()
    grad = torch.randn(sequences, seq_len, shape.dim)
    layers = {}
    for name, factor in (("dropless", 0.0), (f"capacity {capacity_factor:g}", capacity_factor)):
        layer = MoE(shape.dim, shape.hidden, shape.experts, shape.top_k, capacity_factor=factor)
        torch.manual_seed(seed)
        layer.init_weights(0.02)
        with torch.no_grad():
            layer.router.gate.weight.normal_(0.0, shape.dim ** -0.5)  # a router that prefers some experts
        layers[name] = layer
    passthrough = {name: _PassThrough() for name in layers}

    def step(layer: MoE, experts: nn.Module | None) -> None:
        if experts is not None:
            real, layer.experts = layer.experts, experts
        x.grad = None
        layer.zero_grad(set_to_none=True)
        layer(x).backward(grad)
        if experts is not None:
            layer.experts = real

    fns = {}
    for name, layer in layers.items():
        fns[(name, "layer")] = lambda layer=layer: step(layer, None)
        fns[(name, "dispatch")] = lambda layer=layer, name=name: step(layer, passthrough[name])
    for fn in fns.values():
        fn()  # untimed
    for layer in layers.values():
        layer.take_step_stats()
    step(layers[f"capacity {capacity_factor:g}"], None)
    counts, _, dropped = layers[f"capacity {capacity_factor:g}"].take_step_stats()
    ms = _time_ms(fns, torch.device("cpu"), reps, 0)
    return [{"mode": name, "layer_ms": ms[(name, "layer")], "dispatch_ms": ms[(name, "dispatch")],
             "dropped": 0.0 if name == "dropless" else (dropped / counts.sum()).item()} for name in layers]


def capacity_section(args: argparse.Namespace) -> None:
    factor = args.capacity_factor
    print(f"## Dropping mode (capacity factor {factor:g}) against dropless routing")
    print()
    print(f"One debugmodel_moe-shaped layer (dim 256, 8 experts, top-2, 8 x 512 tokens), forward + backward, "
          f"median of {args.reps}:")
    print()
    print("| mode | layer ms | dispatch ms (experts as identity) | choices dropped |")
    print("| --- | ---: | ---: | ---: |")
    for r in bench_capacity_layer(factor, reps=args.reps):
        print(f"| {r['mode']} | {r['layer_ms']:.1f} | {r['dispatch_ms']:.1f} | {100 * r['dropped']:.2f}% |")
    print()
    print(f"debugmodel_moe trained at EP 2 on 2 ranks ({args.ep_steps} steps, seq {args.ep_seq_len}, "
          f"{args.ep_batch} sequences per rank):")
    print()
    print("| mode | tokens/s per rank | step s | all-to-all share of step | choices dropped |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, extra in (("dropless", ()), (f"capacity {factor:g}", ("--moe.capacity_factor", str(factor)))):
        r = train_ep(args, 2, extra)
        print(f"| {name} | {r['tps']:,.0f} | {r['step_s']:.2f} | {100 * r['a2a']:.1f}% | {100 * r['dropped']:.2f}% |")
    print(f"\n(torch {torch.__version__}, {torch.get_num_threads()} CPU threads in this process; gloo, one thread per rank)")


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3's debug model under each layout

# (name, ranks, expert-parallel degree, overrides): every parallelism the family has, at 2 ranks
# (4 for the compositions), and the dropping mode.
DEEPSEEK_LAYOUTS = (
    ("one process", 1, 1, ()),
    ("FSDP 2", 2, 1, ()),
    ("EP 2 (FSDP 2)", 2, 2, ()),
    ("EP 2 (FSDP 2), capacity 1.25", 2, 2, ("--moe.capacity_factor", "1.25")),
    ("TP 2", 2, 1, ("--training.tensor_parallel_degree", "2")),
    ("PP 2 (MTP on the last stage)", 2, 1, ("--experimental.pipeline_parallel_degree", "2",
                                           "--experimental.pipeline_parallel_split_points", "layers.3")),
    ("CP 2 (MTP off)", 2, 1, ("--experimental.context_parallel_degree", "2", "--model.mtp_depth", "0")),
    ("EP 2 x TP 2 (FSDP 2)", 4, 2, ("--training.tensor_parallel_degree", "2")),
)


def deepseek_section(args: argparse.Namespace) -> None:
    """Trains DeepSeek-V3's debugmodel (train_configs/deepseek_v3_debug.toml: 2 dense + 2 MoE
    blocks, MTP 1) under each layout of DEEPSEEK_LAYOUTS: tokens/s per rank, step seconds and the
    all-to-all share of the step."""
    print(f"## DeepSeek-V3 debugmodel per layout ({args.ep_steps} steps, seq {args.ep_seq_len}, "
          f"{args.ep_batch} sequences per data-parallel rank)")
    print()
    print("| layout | ranks | tokens/s per rank | step s | all-to-all share of step | choices dropped |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, nproc, ep, extra in DEEPSEEK_LAYOUTS:
        r = train_ep(args, ep, extra, nproc=nproc, config="deepseek_v3_debug", experts=8)
        print(f"| {name} | {nproc} | {r['tps']:,.0f} | {r['step_s']:.2f} | {100 * r['a2a']:.1f}% | "
              f"{100 * r['dropped']:.2f}% |", flush=True)
    print(f"\n(gloo on {os.cpu_count()} CPU cores, one thread per rank: ranks beyond the core count share cores)")


# ---------------------------------------------------------------------------------------------
# Sections, in the order they run. A section takes the parsed arguments and prints its table.

SECTIONS = {
    "grouped_mm": grouped_mm_section,
    "ep": ep_section,
    "capacity": capacity_section,
    "deepseek": deepseek_section,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=["grouped_mm", "ep", "capacity"],
                        help="default: all but deepseek (about five minutes more)")
    default_devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    parser.add_argument("--devices", nargs="+", choices=["cpu", "cuda"], default=default_devices,
                        help=f"where to run the grouped_mm section (default: {' '.join(default_devices)})")
    parser.add_argument("--tokens", type=int, default=0,
                        help="tokens per layer for every shape (default: each device's, see above)")
    parser.add_argument("--reps", type=int, default=3, help="timed passes; the median is reported")
    parser.add_argument("--warmup", type=int, default=0,
                        help="untimed passes before the timed ones, after the one whose results are compared")
    parser.add_argument("--ep-degrees", type=int, nargs="+", default=[1, 2, 4],
                        help="expert-parallel degrees of the ep section (each on as many ranks)")
    parser.add_argument("--ep-steps", type=int, default=6, help="training steps per ep run")
    parser.add_argument("--ep-seq-len", type=int, default=512)
    parser.add_argument("--ep-batch", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--capacity-factor", type=float, default=1.25, help="the capacity section's dropping mode")
    args = parser.parse_args()
    if "cuda" in args.devices and not torch.cuda.is_available():
        parser.error("--devices cuda: no CUDA device here")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    for i, name in enumerate(args.sections):
        if i:
            print()
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
