#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Measures the pipeline bubble of each schedule: step time against a run without pipelining, and
the share of the schedule's time the ranks spend not computing, next to the theory.

    .venv/bin/python scripts/pipeline_bubble.py [--pp 2] [--schedules 1F1B GPipe ...] [-- overrides]

Each schedule runs the real trainer in the repository root under torchrun (`torchtitan.runtime.launch`;
the run without pipelining is one `python -m torchtitan.train` process), the debug model with
batch 8 x 512 tokens by default. "Measured bubble" comes from the trainer's `pp_bubble_percent`
metric: for each rank, 1 - (time in its stages' forward/backward chunks and loss) / (time in the
schedule's step), averaged over the pp ranks. It therefore includes waiting for neighbours (point-to-point
transfers), not only the idle slots the schedule leaves by design. "Theoretical" is the idle
fraction of the schedule's timetable with equal-cost stages: (p-1)/(m+p-1) for GPipe and 1F1B,
(p-1)/(v*m+p-1) for Interleaved1F1B and for LoopedBFS with m >= p; the zero-bubble schedules have none by design
only when weight gradients cost as much as the idle slots they fill, so no single figure is given.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from torchtitan.config.manager import parse_args
from torchtitan.parallelisms.pipeline import SCHEDULES, plan_pipeline, theoretical_bubble
from torchtitan.tools.runs import TrainingFailed, read_metrics, run_trainer

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_ARGS = ("--job.config_file", str(REPO_ROOT / "train_configs" / "debug_model.toml"),
              "--training.seq_len", "512", "--training.batch_size", "8", "--metrics.log_freq", "1",
              "--metrics.disable_color_printing", "--activation_checkpoint.mode", "none")


def measure(nproc: int, steps: int, warmup: int, overrides: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as dump:
        args = [*BENCH_ARGS, "--training.steps", str(steps), "--training.warmup_steps", "2",
                "--job.dump_folder", dump, *overrides]
        try:
            run_trainer(args, nproc=nproc, timeout=None, cwd=REPO_ROOT)
        except TrainingFailed as e:
            sys.exit(str(e))
        records = read_metrics(Path(dump))[warmup:]
    tokens_per_step = 8 * 512  # per data-parallel rank: every pp rank sees the same batch
    tps = statistics.mean(r["tokens_per_second"] for r in records)
    bubble = [r["pp_bubble_percent"] for r in records if "pp_bubble_percent" in r]
    return {
        "tps": tps,
        # tokens_per_second is per device (divided by pp), so one step takes tokens / (tps * pp).
        "step_s": tokens_per_step / (tps * nproc),
        "bubble": statistics.mean(bubble) if bubble else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline degree (processes)")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), help="schedules to measure")
    parser.add_argument("--microbatches", type=int, default=-1, help="-1 = one per stage")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the averages")
    parser.add_argument("overrides", nargs="*", help="trainer options for every run, after --")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")

    base = measure(1, args.steps, args.warmup, args.overrides)
    print(f"no pipeline: 1 process, {base['step_s']:.2f} s per step, {base['tps']:,.0f} tokens/s per device")
    print()
    print("| schedule | pp | stages/rank | microbatches | s/step | vs no-PP | tokens/s per device "
          "| measured bubble | theoretical bubble |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.schedules:
        pp_args = ["--experimental.pipeline_parallel_degree", str(args.pp),
                   "--experimental.pipeline_parallel_schedule", name,
                   "--experimental.pipeline_parallel_microbatches", str(args.microbatches)]
        plan = plan_pipeline(parse_args([*BENCH_ARGS, *pp_args, *args.overrides]))
        result = measure(args.pp, args.steps, args.warmup, [*pp_args, *args.overrides])
        theory = theoretical_bubble(plan.schedule, plan.pp, plan.microbatches, plan.stages_per_rank)
        print(f"| {plan.schedule} | {plan.pp} | {plan.stages_per_rank} | {plan.microbatches} | {result['step_s']:.2f} "
              f"| {result['step_s'] / base['step_s']:.2f}x | {result['tps']:,.0f} | {result['bubble']:.1f} % "
              f"| {'-' if theory is None else f'{100 * theory:.1f} %'} |", flush=True)


if __name__ == "__main__":
    main()
