#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Where a training step's time goes, by op category, with achieved TFLOP/s against the peak.

    .venv/bin/python scripts/step_breakdown.py --config debug_model --nproc 1 --threads 1 [-- overrides...]

Runs the real trainer in the repository root as scripts/benchmark.py does (torchrun when --nproc
> 1, OMP_NUM_THREADS = --threads) with its own profiler on: `--profiling.profile_freq N` records
step N (--profile-step) after N - 2 plain steps and one profiler warm-up step, one chrome trace
per rank. Each trace is broken down by torchtitan/tools/op_breakdown.py (how time is attributed is
explained there): a markdown table for rank 0, and the mean over ranks when there are several,
each with communication split into exposed (in the step's sum) and overlapped (hidden under the rest).
The model's TFLOP/s and MFU are the trainer's own (metrics.jsonl of rank 0) for the profiled step,
next to the tokens/s of the steps run without the profiler (on a shared machine, noise can
exceed what profiling costs). Inductor's CPU kernels are
recorded (TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1), so `--training.compile` runs show their fused
kernels by name. --from-dump reads the traces of an earlier run instead of training.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from torchtitan.observability.metrics import cpu_peak_flops, gpu_peak_flops
from torchtitan.tools.op_breakdown import CATEGORIES, LABELS, Breakdown, load_breakdown, mean_breakdown
from torchtitan.tools.runs import TrainingFailed, read_metrics, run_trainer

REPO_ROOT = Path(__file__).resolve().parents[1]
TRACES_FOLDER = "profile_traces"


def profile_run(config: str, nproc: int, threads: int, step: int, overrides: list[str], dump: Path) -> None:
    """Trains `step` steps with step `step` profiled, outputs in `dump`."""
    path = Path(config) if config.endswith(".toml") else REPO_ROOT / "train_configs" / f"{config}.toml"
    args = ["--job.config_file", str(path), "--training.steps", str(step), "--training.warmup_steps",
            str(min(step, 2)), "--metrics.log_freq", "1", "--metrics.disable_color_printing",
            "--job.dump_folder", str(dump), "--profiling.enable_profiling", "--profiling.profile_freq", str(step),
            "--profiling.save_traces_folder", TRACES_FOLDER, *overrides]
    env = {"OMP_NUM_THREADS": str(threads), "TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE": "1"}
    try:
        run_trainer(args, nproc=nproc, timeout=None, extra_env=env, cwd=REPO_ROOT)
    except TrainingFailed as e:
        sys.exit(str(e))


def find_traces(dump: Path, step: int | None = None) -> tuple[int, list[Path]]:
    """(step, rank traces in rank order) of profiled step `step` in `dump`, by default the last one."""
    folders = sorted((dump / TRACES_FOLDER).glob("iteration_*"), key=lambda f: int(f.name.split("_")[1]))
    folders = [f for f in folders if step is None or f.name == f"iteration_{step}"]
    traces = sorted(folders[-1].glob("rank*_trace.json"), key=lambda f: int(re.findall(r"\d+", f.name)[0])) \
        if folders else []
    if not traces:
        sys.exit(f"no profiler traces{'' if step is None else f' of step {step}'} in {dump / TRACES_FOLDER}")
    return int(folders[-1].name.split("_")[1]), traces


def peak_flops(b: Breakdown, threads: int) -> tuple[float | None, str]:
    """The device's matmul peak in the dtype the matmuls ran in, as the trainer's MFU uses it."""
    if b.compute_dtype is None:
        return None, "no matmuls in the trace"
    dtype = getattr(torch, b.compute_dtype)
    if b.device_name is not None:
        peak = gpu_peak_flops(b.device_name, dtype)
        return peak, f"datasheet figure for {b.device_name}, {b.compute_dtype}" if peak else f"unknown GPU {b.device_name}"
    torch.set_num_threads(threads)  # the cache is per thread count: the trainer's ranks had `threads`
    peak, source = cpu_peak_flops(dtype)
    return peak, f"CPU, {b.compute_dtype}, {source}"


def step_metrics(dump: Path, step: int) -> dict:
    """The profiled step's row of metrics.jsonl, and the mean tokens/s of the steps that ran without
    the profiler (after the first, before the profiler's warm-up step)."""
    if not (dump / "metrics.jsonl").exists():
        return {}
    rows = read_metrics(dump)
    profiled = next((r for r in rows if r["step"] == step), None)
    plain = [r for r in rows if 2 <= r["step"] <= step - 2]
    return {"profiled": profiled, "plain_steps": [r["step"] for r in plain],
            "plain_tokens_per_second": statistics.mean(r["tokens_per_second"] for r in plain) if plain else None,
            "plain_mfu_percent": statistics.mean(r["mfu_percent"] for r in plain) if plain else None}


def table(b: Breakdown, peak: float | None, metrics: dict) -> str:
    def achieved(category: str) -> str:
        tflops = b.tflops(category)
        if tflops is None:
            return ""
        return f"{tflops:.3f}" + (f" ({100 * tflops * 1e12 / peak:.0f} % of peak)" if peak else "")

    lines = ["| category | ms per step | share % | achieved TFLOP/s |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {LABELS[c]} | {b.ms[c]:,.1f} | {b.share(c):.1f} | {achieved(c)} |" for c in CATEGORIES]
    row = metrics.get("profiled")
    model = f"{row['tflops']:.3f} model (MFU {row['mfu_percent']:.1f} %)" if row else ""
    lines.append(f"| **step** | **{b.step_ms:,.1f}** | **100.0** | {model} |")
    lines.append(f"| communication overlapped (hidden, not in the step) | {b.overlapped_ms:,.1f} | "
                 f"{100 * b.overlapped_ms / b.step_ms if b.step_ms else 0:.1f} | |")
    return "\n".join(lines)


def exposure_line(b: Breakdown) -> str:
    e = b.exposure()
    return (f"Per step: compute {e['compute']:,.1f} ms, exposed communication {e['exposed_comm']:,.1f} ms, "
            f"overlapped communication {e['overlapped_comm']:,.1f} ms, idle/other {e['other']:,.1f} ms.")


def report(breakdowns: list[Breakdown], peak: float | None, source: str, step: int, metrics: dict) -> str:
    b0 = breakdowns[0]
    out = [f"Step {step}, {b0.timeline}, rank 0:", "", table(b0, peak, metrics), "", exposure_line(b0)]
    if len(breakdowns) > 1:
        mean = mean_breakdown(breakdowns)
        out += ["", f"Mean over {len(breakdowns)} ranks:", "", table(mean, peak, metrics), "", exposure_line(mean)]
    out += ["", f"Peak: {peak / 1e12:.3f} TFLOP/s ({source})." if peak else f"Peak: none ({source})."]
    if metrics.get("profiled"):
        line = f"Tokens/s (rank 0): {metrics['profiled']['tokens_per_second']:,.0f} in the profiled step"
        if metrics["plain_tokens_per_second"]:
            line += (f", {metrics['plain_tokens_per_second']:,.0f} in the plain steps {metrics['plain_steps']} "
                     f"(MFU {metrics['plain_mfu_percent']:.1f} %)")
        out.append(line + ".")
    if b0.other_threads_ms:
        out.append(f"Other threads of rank 0 were busy {b0.other_threads_ms:,.1f} ms (not in the shares).")
    out += [f"Note: {note}." for note in b0.notes]
    out += ["", "Largest self times of rank 0 (ms per step):", ""]
    for c in CATEGORIES:
        if b0.top.get(c):
            out.append(f"- {LABELS[c]}: " + ", ".join(f"{name[:80]} {ms:,.1f}" for name, ms in b0.top[c]))
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--config", default="debug_model", help="name in train_configs/ or a .toml path")
    parser.add_argument("--nproc", type=int, default=1, help="processes (ranks)")
    parser.add_argument("--threads", type=int, default=0, help="OMP threads per process (0 = cores / nproc)")
    parser.add_argument("--profile-step", type=int, default=5,
                        help="the step traced, and the run's length (at least 2; 5 leaves steps 2-3 unprofiled)")
    parser.add_argument("--top", type=int, default=4, help="largest event names listed per category")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH ('-': stdout only)")
    parser.add_argument("--dump", metavar="DIR", help="keep the run's outputs (traces, metrics.jsonl) in DIR")
    parser.add_argument("--from-dump", metavar="DIR", help="analyse the traces of an earlier run in DIR, train nothing")
    parser.add_argument("overrides", nargs="*", help="trainer options, after --")
    args = parser.parse_args()
    if args.profile_step < 2:
        parser.error("--profile-step must be at least 2 (one profiler warm-up step precedes it)")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.nproc)

    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(args.from_dump or args.dump or tmp)
        if not args.from_dump:
            profile_run(args.config, args.nproc, threads, args.profile_step, args.overrides, dump)
        step, traces = find_traces(dump, None if args.from_dump else args.profile_step)
        breakdowns = [load_breakdown(trace, args.top) for trace in traces]
        metrics = step_metrics(dump, step)
    peak, source = peak_flops(breakdowns[0], threads)
    if args.json:
        result = {"config": args.from_dump or args.config, "nproc": len(breakdowns), "threads": threads,
                  "overrides": args.overrides, "step": step, "peak_flops": peak, "peak_source": source, "metrics": metrics,
                  "ranks": [b.to_json() for b in breakdowns], "mean": mean_breakdown(breakdowns).to_json()}
        text = json.dumps(result, indent=1)
        if args.json == "-":
            print(text)
            return
        Path(args.json).write_text(text + "\n")
    source_line = f"dump {args.from_dump}" if args.from_dump else f"config {args.config}"
    print(f"{source_line}  ranks {len(breakdowns)}  threads/rank {threads}  overrides "
          f"{' '.join(args.overrides) or '-'}\n")
    print(report(breakdowns, peak, source, step, metrics))


if __name__ == "__main__":
    main()
