#!/usr/bin/env python
"""Checks the dry run's memory estimates against real runs, layout by layout (docs/memory.md).

For each layout: the estimate of one process on fake tensors (the dry run), and the same layout
run as a real job of that many processes, each rank measuring its own second training step with
the same tracker. Prints a markdown table: the most loaded simulated rank's estimate, measurement
and error, and the worst error over every rank the dry run simulated (one per pipeline stage).

  python scripts/memory_accuracy.py                       # every layout, debug, 100M and MoE models
  python scripts/memory_accuracy.py --only fsdp2 pp2_1f1b --models debug

On this project's CPU machine it runs the real jobs on gloo; on a GPU machine, on the GPUs (the
dry run then stands for CUDA too).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's torchtitan, from any folder

from torchtitan.estimation.accuracy import HEADER, compare  # noqa: E402
from torchtitan.logging import init_logger  # noqa: E402

DENSE = ["--job.config_file", "bundled:train_configs/debug_model.toml"]
MODELS = {
    "debug": [*DENSE, "--model.flavor", "debugmodel", "--training.seq_len", "512", "--training.batch_size", "4"],
    "100M": [*DENSE, "--model.flavor", "100M", "--training.seq_len", "512", "--training.batch_size", "2"],
    # Qwen3 MoE debug: routing on fake tensors is balanced, the real run's is what the router picks.
    "moe": ["--job.config_file", "bundled:train_configs/qwen3_moe_debug.toml", "--training.seq_len", "512",
            "--training.batch_size", "4"],
}
FSDP2 = ["--training.data_parallel_shard_degree", "2"]
PP2 = ["--experimental.pipeline_parallel_degree", "2"]
# name -> (processes, options)
LAYOUTS = {
    "fsdp2": (2, FSDP2),
    "hsdp2x2": (4, ["--training.data_parallel_replicate_degree", "2", "--training.data_parallel_shard_degree", "2"]),
    "ddp2": (2, ["--training.data_parallel_replicate_degree", "2", "--training.data_parallel_shard_degree", "1"]),
    "tp2": (2, ["--training.tensor_parallel_degree", "2"]),
    "fsdp2_tp2": (4, [*FSDP2, "--training.tensor_parallel_degree", "2"]),
    "fsdp2_tp2_ac_full": (4, [*FSDP2, "--training.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "full"]),
    "cp2": (2, ["--experimental.context_parallel_degree", "2"]),
    "pp2_1f1b": (2, PP2),
    "pp2_interleaved": (2, [*PP2, "--experimental.pipeline_parallel_schedule", "Interleaved1F1B",
                            "--experimental.pipeline_parallel_microbatches", "2"]),
    # Zero-bubble schedules are estimated (the replay runs their weight halves as full backwards)
    # but cannot be measured: PyTorch's module tracker fails inside their autograd.grad calls.
    "fsdp2_pp2": (4, [*FSDP2, *PP2]),
    "pp2_gpipe": (2, [*PP2, "--experimental.pipeline_parallel_schedule", "GPipe"]),
    "fsdp2_ac_full": (2, [*FSDP2, "--activation_checkpoint.mode", "full"]),
    "fsdp2_ac_selective": (2, [*FSDP2, "--activation_checkpoint.mode", "selective"]),
    "tp2_ac_op": (2, ["--training.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "selective",
                      "--activation_checkpoint.selective_ac_option", "op"]),
    "fsdp2_accum2": (2, [*FSDP2, "--training.gradient_accumulation_steps", "2"]),
    # The dry run simulates 2 of these 4 micro-steps (the first and the last); the real run takes all 4.
    "fsdp2_accum4": (2, [*FSDP2, "--training.gradient_accumulation_steps", "4"]),
    "pp2_accum3": (2, [*PP2, "--training.gradient_accumulation_steps", "3"]),
    "fsdp2_offload": (2, [*FSDP2, "--training.enable_cpu_offload"]),
    # On a GPU the float8 matmuls run on float8 units; on the CPU emulated, with the same tensors kept.
    "fsdp2_float8": (2, [*FSDP2, "--float8.enable_float8_linear", "--float8.emulate"]),
    "fsdp2_ep2": (2, [*FSDP2, "--training.expert_parallel_degree", "2"]),
}
# The layouts each model is measured in (the MoE model in those that place its experts differently).
MODEL_LAYOUTS = {"moe": ["fsdp2", "fsdp2_ep2", "tp2"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", choices=sorted(LAYOUTS), help="these layouts (default: all)")
    p.add_argument("--models", nargs="*", choices=sorted(MODELS), default=list(MODELS))
    ns = p.parse_args(argv)
    init_logger()
    import logging

    logging.getLogger("torchtitan").setLevel(logging.WARNING)  # the table only
    print(HEADER, flush=True)
    start = time.perf_counter()
    for model in ns.models:
        default = MODEL_LAYOUTS.get(model, [n for n in LAYOUTS if n != "fsdp2_ep2"])
        for name in ns.only or default:
            nproc, options = LAYOUTS[name]
            args = ["--metrics.disable_color_printing", *MODELS[model], *options]
            print(compare(f"{model} {name}", args, nproc).row(), flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
