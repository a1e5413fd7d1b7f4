#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Measures training throughput of a config: tokens/s per device, TFLOP/s, MFU, peak memory.

    .venv/bin/python scripts/benchmark.py --config debug_model --nproc 2 --steps 12 [-- overrides...]

Runs the real trainer in the repository root as users do (`python -m torchtitan.train`, or
torchrun through `torchtitan.runtime.launch` when --nproc > 1), logging every step, and averages the steps
after --warmup. Figures come from the trainer's own metrics (metrics.jsonl of rank 0).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from torchtitan.tools.runs import TrainingFailed, read_metrics, run_trainer

REPO_ROOT = Path(__file__).resolve().parents[1]


def run(config: str, nproc: int, steps: int, overrides: list[str], threads: int) -> list[dict]:
    path = Path(config) if config.endswith(".toml") else REPO_ROOT / "train_configs" / f"{config}.toml"
    with tempfile.TemporaryDirectory() as dump:
        # Warm-up no longer than the run (the trainer refuses more); overrides may change it.
        args = ["--job.config_file", str(path), "--training.steps", str(steps), "--training.warmup_steps",
                str(min(steps, 2)), "--metrics.log_freq", "1",
                "--metrics.disable_color_printing", "--job.dump_folder", dump, *overrides]
        try:
            run_trainer(args, nproc=nproc, timeout=None, extra_env={"OMP_NUM_THREADS": str(threads)}, cwd=REPO_ROOT)
        except TrainingFailed as e:
            sys.exit(str(e))
        return read_metrics(Path(dump))  # the step rows, without the setup record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="debug_model", help="name in train_configs/ or a .toml path")
    parser.add_argument("--nproc", type=int, default=1, help="processes (ranks)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the averages")
    parser.add_argument("--threads", type=int, default=0, help="OMP threads per process (0 = cores / nproc)")
    parser.add_argument("overrides", nargs="*", help="trainer options, after --")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.nproc)

    records = run(args.config, args.nproc, args.steps, args.overrides, threads)[args.warmup :]
    tps = statistics.mean(r["tokens_per_second"] for r in records)
    spread = statistics.pstdev(r["tokens_per_second"] for r in records)
    print(f"config {args.config}  ranks {args.nproc}  threads/rank {threads}  steps {args.steps} "
          f"(first {args.warmup} left out)  overrides {' '.join(args.overrides) or '-'}")
    print(f"tokens/s per device: {tps:,.0f} (+- {spread:,.0f})")
    print(f"TFLOP/s per device:  {statistics.mean(r['tflops'] for r in records):.4f}")
    print(f"MFU:                 {statistics.mean(r['mfu_percent'] for r in records):.1f} %")
    print(f"peak memory (rank 0): {max(r['memory_peak_gib'] for r in records):.2f} GiB")
    print(f"data loading share:  {statistics.mean(r['data_loading_percent'] for r in records):.2f} %")
    print(f"final loss:          {records[-1]['loss']:.4f}")


if __name__ == "__main__":
    main()
