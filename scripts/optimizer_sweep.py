#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""AdamW against Muon on the bundled corpus: a small learning-rate sweep for each, at equal tokens,
compared by the held-out loss at the last step (docs/optimizers.md).

    python scripts/optimizer_sweep.py [--steps 200] [--lrs 1e-3 3e-3 1e-2] [--optimizers AdamW Muon]
        [--seq-len 64] [--batch-size 8] [--workdir DIR] [--nproc 1]

Every run trains the debug model (train_configs/debug_model.toml) from the same seed for the same
steps and global batch, with the same warm-up and linear decay, and validates on the held-out
share of the corpus (validation.*) at its last step. The learning rate is optimizer.lr: AdamW's,
and under Muon both AdamW's (embeddings, output, norms) and Muon's (its update scale
match_adamw_rms makes one lr fit both). Prints a Markdown table, one row per run, then the best
learning rate of each optimizer. Each run is a separate process (a single rank unless --nproc).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from torchtitan.tools.runs import read_metrics, read_validations, run_trainer

OPTIMIZERS = ("AdamW", "Muon")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run (equal tokens for every run)")
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2], help="optimizer.lr values")
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (the global batch)")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--validation-steps", type=int, default=10, help="held-out batches at the end")
    p.add_argument("--nproc", type=int, default=1, help="ranks per run (FSDP over them)")
    p.add_argument("--workdir", type=Path, help="keep the runs here (default: a temporary folder)")
    p.add_argument("--extra", default="", help="more trainer overrides for every run, e.g. '--model.flavor tiny'")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup_steps > args.steps:
        p.error(f"--steps must be >= 1 and >= --warmup-steps (got {args.steps} and {args.warmup_steps})")
    if args.batch_size % args.nproc:
        p.error(f"--batch-size {args.batch_size} must divide by --nproc {args.nproc}")
    if any(lr <= 0 for lr in args.lrs):
        p.error(f"every --lrs value must be > 0, got {args.lrs}")
    return args


def run_args(args: argparse.Namespace, optimizer: str, lr: float, folder: Path) -> list[str]:
    return ["--job.config_file", "bundled:train_configs/debug_model.toml", "--job.dump_folder", str(folder),
            "--optimizer.name", optimizer, "--optimizer.lr", str(lr),
            "--training.steps", str(args.steps), "--training.warmup_steps", str(args.warmup_steps),
            "--training.decay_type", "linear", "--training.seq_len", str(args.seq_len),
            "--training.batch_size", str(args.batch_size // args.nproc), "--training.dataset_shards", "4",
            "--metrics.log_freq", "10", "--metrics.disable_color_printing",
            "--validation.enabled", "--validation.freq", str(args.steps), "--validation.steps", str(args.validation_steps),
            *args.extra.split()]


def sweep(args: argparse.Namespace, workdir: Path) -> list[dict]:
    rows = []
    print("| optimizer | lr | train loss (last 10 steps) | held-out loss | held-out ppl | s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |", flush=True)
    for optimizer in args.optimizers:
        for lr in args.lrs:
            folder = workdir / f"{optimizer}_lr{lr:g}"
            start = time.perf_counter()
            run_trainer(run_args(args, optimizer, lr, folder), nproc=args.nproc, timeout=None)
            seconds = time.perf_counter() - start
            losses = [r["loss"] for r in read_metrics(folder)]
            last = read_validations(folder)[-1]
            row = {"optimizer": optimizer, "lr": lr, "train": sum(losses[-10:]) / len(losses[-10:]),
                   "held_out": last["loss"], "ppl": last.get("perplexity", float("nan")), "seconds": seconds}
            rows.append(row)
            print(f"| {optimizer} | {lr:g} | {row['train']:.4f} | {row['held_out']:.4f} | {row['ppl']:.2f} | "
                  f"{seconds:.0f} |", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = sweep(args, args.workdir or Path(tmp))
    print()
    for optimizer in args.optimizers:
        best = min((r for r in rows if r["optimizer"] == optimizer), key=lambda r: r["held_out"])
        print(f"best {optimizer}: lr {best['lr']:g}, held-out loss {best['held_out']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
