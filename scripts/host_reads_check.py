#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Counts the host reads of steady-state training steps per layout (docs/performance.md, "Host reads").

    python scripts/host_reads_check.py                          # every layout, 2-4 CPU ranks each
    python scripts/host_reads_check.py --layouts fsdp,tp,moe_ep
    python scripts/host_reads_check.py --layouts single,moe --out report.json   # one GPU

Each layout trains the debug model (an MoE layout: Qwen3's debug MoE) for a few steps with
`profiling.audit_host_reads`, logging only its first and last step, and the script prints, per
layout, the reads of a steady-state step, those of the steps that log or save, the deferred ones (the agreement read a step late) and, on CUDA, what
PyTorch's sync debug mode saw. "Per step" is the most of any rank in any step after the first.
Extra trainer options follow `--`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

DEBUG = ("--job.config_file", "bundled:train_configs/debug_model.toml")
MOE = ("--job.config_file", "bundled:train_configs/qwen3_moe_debug.toml")
# name: (ranks, trainer options)
LAYOUTS = {
    "single": (1, DEBUG),
    "fsdp": (2, (*DEBUG, "--training.data_parallel_shard_degree", "2")),
    "hsdp": (4, (*DEBUG, "--training.data_parallel_replicate_degree", "2", "--training.data_parallel_shard_degree", "2")),
    "tp": (2, (*DEBUG, "--training.tensor_parallel_degree", "2")),
    "pp": (2, (*DEBUG, "--experimental.pipeline_parallel_degree", "2")),
    "cp": (2, (*DEBUG, "--experimental.context_parallel_degree", "2")),
    "moe": (1, MOE),
    "moe_capacity": (1, (*MOE, "--moe.capacity_factor", "1.25")),
    "moe_ep": (2, (*MOE, "--training.data_parallel_shard_degree", "2", "--training.expert_parallel_degree", "2")),
    "dsv3": (1, ("--job.config_file", "bundled:train_configs/deepseek_v3_debug.toml")),
    "moe_ep_capacity": (2, (*MOE, "--training.data_parallel_shard_degree", "2", "--training.expert_parallel_degree", "2",
                            "--moe.capacity_factor", "1.25")),
}
CPU_DEFAULT = ("single", "fsdp", "hsdp", "tp", "pp", "cp", "moe", "moe_capacity", "moe_ep", "moe_ep_capacity", "dsv3")


def run_layout(name: str, steps: int, seq_len: int, work: Path, extra: list[str]) -> dict:
    nproc, options = LAYOUTS[name]
    folder = work / name
    args = [*options, "--training.steps", str(steps), "--training.seq_len", str(seq_len), "--training.warmup_steps", "2",
            "--metrics.log_freq", "1000", "--profiling.audit_host_reads", "--job.dump_folder", str(folder), *extra]
    env = {**os.environ, "NGPU": str(nproc)}
    env.setdefault("OMP_NUM_THREADS", "1")
    # One rank runs in this Python (a GPU machine without the project's venv); more go through the launcher.
    command = [sys.executable, "-m", "torchtitan.train"] if nproc == 1 else [str(REPO_ROOT / "run_llama_train.sh")]
    result = subprocess.run([*command, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    reports = [json.loads(p.read_text()) for p in sorted((folder / "host_reads").glob("rank*.json"))]
    if result.returncode != 0 or not reports:
        return {"layout": name, "error": f"exit code {result.returncode}: {(result.stderr or result.stdout)[-800:]}"}
    first = reports[0]["first_step"]
    lines: Counter = Counter()
    per_step: Counter = Counter()  # (rank, step) -> stalls outside the scheduled work
    for rank, report in enumerate(reports):
        lines.update(report["steady_state_by_line"])
        per_step.update((rank, r["step"]) for r in report["reads"]
                        if r["step"] is not None and r["step"] > first and not r["deferred"] and not r["scheduled"])
    return {
        "layout": name, "ranks": nproc,
        "steady_state_per_step": max(per_step.values(), default=0),  # the most of any rank in any step after the first
        "steady_state": [r["steady_state"] for r in reports],
        "scheduled": [r["scheduled"] for r in reports],
        "deferred": [r["deferred"] for r in reports],
        "cuda_syncs_steady": [r.get("steady_state_cuda_syncs", 0) for r in reports],
        "lines": dict(lines),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(CPU_DEFAULT), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("extra", nargs="*", help="trainer options for every layout (after --)")
    args = parser.parse_args(argv)
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout {unknown[0]}; choose from {', '.join(LAYOUTS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="host_reads_") as work:
        for name in names:
            row = run_layout(name, args.steps, args.seq_len, Path(work), args.extra)
            rows.append(row)
            if "error" in row:
                print(f"{name:16s} failed: {row['error']}")
                continue
            where = "; ".join(f"{n}x {line}" for line, n in row["lines"].items()) or "-"
            print(f"{name:16s} ranks {row['ranks']}  steady-state reads per step {row['steady_state_per_step']}  "
                  f"(per rank over steps 2-{args.steps}: {row['steady_state']}; CUDA syncs {row['cuda_syncs_steady']}); "
                  f"on logging/saving steps {row['scheduled']}; deferred {row['deferred']}  where: {where}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
