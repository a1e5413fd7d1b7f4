#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Checkpoint cost on this machine: how long each save blocks training, per checkpoint.async_mode,
and the save / load throughput.

    .venv/bin/python scripts/checkpoint_bench.py [--nproc 2] [--layers 16] [--dim 768] [--steps 12] [--interval 4]

Trains a Llama 3 of about 115 M parameters (dim 768, 16 blocks; AdamW, fp32, so a checkpoint is
about 1.3 GiB) with FSDP over --nproc CPU ranks, saving every --interval steps, once per mode
(disabled, async, async_with_pinned_mem), then resumes from the last checkpoint to time a load.
Each job is the real trainer under torchrun (`torchtitan.runtime.launch`), started in the repository root;
the benchmark's flavor is registered on every rank by a small module it writes and names with
`--experimental.custom_import`, as a user registers their own model.
Figures come from the trainer's own log lines; the table reports for each mode the seconds the
training loop waited per save (mean over the saves after the first, which pays one-time set-up),
the seconds from the start of a save until its checkpoint was complete and visible, the write
throughput and the job's wall time.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from torchtitan.tools.runs import run_trainer

REPO_ROOT = Path(__file__).resolve().parents[1]
MODES = ("disabled", "async", "async_with_pinned_mem")
FLAVOR = "checkpoint_bench"
FLAVOR_MODULE = "checkpoint_bench_flavor"
WAITED = re.compile(r"the training loop waited ([\d.]+)s")
SAVED = re.compile(r"saved checkpoint \S+ \(([\d.]+) MiB.*\) in ([\d.]+)s \(([\d.]+) MiB/s")
LOADED = re.compile(r"loaded .* in ([\d.]+)s \(([\d.]+) MiB/s\)")


def write_flavor_module(folder: Path, dim: int, layers: int) -> None:
    """Writes the module that registers the benchmark's Llama 3 flavor when a rank imports it."""
    (folder / f"{FLAVOR_MODULE}.py").write_text(
        f'''"""Registers the llama3 flavor {FLAVOR!r} (written by scripts/checkpoint_bench.py)."""

import dataclasses

from torchtitan.models.llama import llama3_configs

llama3_configs[{FLAVOR!r}] = dataclasses.replace(llama3_configs["debugmodel"], dim={dim}, n_layers={layers},
                                                 n_heads={dim // 64})
''')


def run_job(args: argparse.Namespace, modules: Path, dump: Path, steps: int, mode: str) -> tuple[str, float]:
    trainer_args = [
        "--job.config_file", "bundled:train_configs/debug_model.toml", "--experimental.custom_import", FLAVOR_MODULE,
        "--model.flavor", FLAVOR,
        "--training.seq_len", str(args.seq_len), "--training.batch_size", str(args.batch_size),
        "--training.steps", str(steps), "--metrics.log_freq", "1", "--metrics.disable_color_printing",
        "--checkpoint.enable_checkpoint", "--checkpoint.interval", str(args.interval),
        "--checkpoint.async_mode", mode, "--job.dump_folder", str(dump),
    ]
    python_path = os.pathsep.join(p for p in (str(modules), os.environ.get("PYTHONPATH", "")) if p)
    start = time.perf_counter()
    result = run_trainer(trainer_args, nproc=args.nproc, timeout=None, check=False, cwd=REPO_ROOT,
                         extra_env={"PYTHONPATH": python_path})
    if result.returncode != 0:
        sys.exit(f"{mode}: the job failed\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout + result.stderr, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_flavor_module(Path(tmp), args.dim, args.layers)
        for mode in args.modes:
            log, wall = run_job(args, Path(tmp), Path(tmp) / mode, args.steps, mode)
            saves = [(float(m), float(s), float(r)) for m, s, r in SAVED.findall(log)]
            if mode == "disabled":  # every rank waits for the whole save
                waited = [s for _, s, _ in saves]
            else:  # each rank logs its own wait: the slowest rank holds the others back
                waits = [float(w) for w in WAITED.findall(log)]
                waited = [max(waits[i : i + args.nproc]) for i in range(0, len(waits), args.nproc)]
            later = saves[1:] or saves  # the first save pays one-time set-up (buffers, the writer process)
            rows.append((mode, saves[0][0], statistics.mean(waited[1:] or waited), statistics.mean(s for _, s, _ in later),
                         statistics.mean(r for _, _, r in later), wall))
        log, _ = run_job(args, Path(tmp), Path(tmp) / "disabled", args.steps + 1, "disabled")
        load_seconds, load_rate = map(float, LOADED.findall(log)[0])

    params = re.search(r"model llama3 \S+: ([\d,]+) parameters", log).group(1)
    print(f"model: {params} parameters (dim {args.dim}, {args.layers} blocks); {args.nproc} ranks (FSDP), fp32 AdamW; "
          f"{args.steps} steps of {args.batch_size} x {args.seq_len} tokens per rank, a save every {args.interval}")
    print("| async_mode | checkpoint MiB | training waited per save (s) | save complete after (s) | write MiB/s | job wall (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for mode, mib, waited, complete, rate, wall in rows:
        print(f"| {mode} | {mib:,.0f} | {waited:.2f} | {complete:.2f} | {rate:,.0f} | {wall:.1f} |")
    print(f"load (resume of the disabled run): {load_seconds:.2f} s, {load_rate:,.0f} MiB/s")


if __name__ == "__main__":
    main()
