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
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from torchtitan.tools.runs import read_metrics, run_trainer

GROUPS = 2


def _lighthouse(port: int) -> subprocess.Popen:
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    proc = subprocess.Popen([str(binary) if binary.exists() else "torchft_lighthouse", "--min_replicas", str(GROUPS),
                             "--bind", f"[::]:{port}", "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "2000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("localhost", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the lighthouse did not open port {port}")


def run_mode(mode: str, args: argparse.Namespace, folder: Path) -> list[list[dict]]:
    """Trains both groups of one mode at once; returns each group's metrics records."""
    common = ["--job.config_file", "train_configs/debug_model.toml", "--training.steps", str(args.steps),
              "--training.seq_len", str(args.seq_len), "--training.batch_size", str(args.batch_size),
              "--metrics.log_freq", "1", "--job.dump_folder", str(folder), "--fault_tolerance.enable",
              "--fault_tolerance.group_size", str(GROUPS), "--fault_tolerance.min_replica_size", str(GROUPS),
              "--fault_tolerance.lighthouse", f"localhost:{args.port}", "--fault_tolerance.semi_sync_method", mode,
              "--fault_tolerance.sync_steps", str(args.sync_steps)]
    errors: list[BaseException] = []

    def one(group: int) -> None:
        try:
            run_trainer([*common, "--fault_tolerance.replica_id", str(group)], timeout=3600)
        except BaseException as e:  # noqa: BLE001 - raised below, after the other group ends
            errors.append(e)

    threads = [threading.Thread(target=one, args=(g,)) for g in range(GROUPS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
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
    lighthouse = _lighthouse(args.port)
    rows = []
    try:
        for mode in args.modes.split(","):
            started = time.perf_counter()
            groups = run_mode(mode, args, workdir / mode)
            rows.append((mode, final_loss(groups), time.perf_counter() - started))
    finally:
        lighthouse.kill()
        lighthouse.wait()
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
