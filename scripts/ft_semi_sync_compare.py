#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Compares the fault-tolerant modes at equal tokens: synchronous HSDP (gradients averaged every
step), local SGD and DiLoCo (parameters synced every H steps), each as two replica groups of one
rank on the debug model, joined by a lighthouse this script starts. Prints a table of each mode's
final loss: the mean of the groups' logged losses over the last 10 steps.

    PYTHONPATH=. .venv/bin/python scripts/ft_semi_sync_compare.py --steps 200 --sync-steps 10

docs/fault_tolerance.md ("Semi-synchronous modes") has the table this wrote.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from torchtitan.tools.replica_groups import lighthouse, run_replica_groups
from torchtitan.tools.runs import read_metrics

GROUPS = 2


def run_mode(mode: str, args: argparse.Namespace, folder: Path) -> list[list[dict]]:
    """Trains both groups of one mode at once; returns each group's metrics records."""
    common = ["--job.config_file", "train_configs/debug_model.toml", "--training.steps", str(args.steps),
              "--training.seq_len", str(args.seq_len), "--training.batch_size", str(args.batch_size),
              "--metrics.log_freq", "1", "--job.dump_folder", str(folder), "--fault_tolerance.enable",
              "--fault_tolerance.group_size", str(GROUPS), "--fault_tolerance.min_replica_size", str(GROUPS),
              "--fault_tolerance.lighthouse", f"localhost:{args.port}", "--fault_tolerance.semi_sync_method", mode,
              "--fault_tolerance.sync_steps", str(args.sync_steps)]
    run_replica_groups(common, GROUPS, timeout=3600)
    return [read_metrics(folder / f"replica_{g}") for g in range(GROUPS)]


def final_loss(groups: list[list[dict]], last: int = 10) -> float:
    losses = [r["loss"] for records in groups for r in records[-last:]]
    return sum(losses) / len(losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-steps", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--port", type=int, default=29650)
    parser.add_argument("--modes", default="none,local_sgd,diloco")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="ft_semi_sync_"))
    rows = []
    try:
        with lighthouse(GROUPS, port=args.port):
            for mode in args.modes.split(","):
                started = time.perf_counter()
                groups = run_mode(mode, args, workdir / mode)
                rows.append((mode, final_loss(groups), time.perf_counter() - started))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    tokens = args.steps * GROUPS * args.batch_size * args.seq_len
    print(f"{GROUPS} groups x 1 rank, debug model, {args.steps} steps x {GROUPS} x {args.batch_size} x {args.seq_len} "
          f"= {tokens:,} tokens, H = {args.sync_steps}")
    print("| mode | final loss (mean of both groups, last 10 steps) | vs synchronous | wall |")
    print("|---|---|---|---|")
    base = dict((m, loss) for m, loss, _ in rows).get("none")
    for mode, loss, seconds in rows:
        delta = f"{loss - base:+.3f}" if base is not None else "-"
        print(f"| {mode} | {loss:.3f} | {delta} | {seconds:.0f} s |")


if __name__ == "__main__":
    main()
