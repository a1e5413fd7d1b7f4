#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Checks the dry run's memory estimates against real runs, layout by layout (docs/memory.md).

For each layout: the estimate of one process on fake tensors (the dry run), and the same layout
run as a real job of that many processes, each rank measuring its own second training step with
the same tracker. Prints a markdown table: the most loaded simulated rank's estimate, measurement
and error, and the worst error over every rank the dry run simulated (one per pipeline stage).

  python scripts/memory_accuracy.py                       # every layout, debug, 100M and MoE models
  python scripts/memory_accuracy.py --only fsdp2 pp2_1f1b --models debug

On this project's CPU machine it runs the real jobs on gloo; on a GPU machine, on the GPUs (the
dry run then stands for CUDA too).

How one layout is compared (`compare`): the estimate runs here, in this process, on fake tensors
(torchtitan.estimation.dry_run); the measurement runs the same layout as a real job of `nproc`
processes (gloo on the CPU, or GPUs) through a `Runner` (torchtitan/tools/runs.py; the test suite
passes its warm one), each rank measuring its own second step (`--memory_estimation.disable_fake_mode`),
and rank 0 printing every rank's figures on a `MEASURED <json>` line. Both sides stand for the same
device (`--job.dry_run_device` set to the one the real job runs on), so they differ only where fake
and real execution do.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's torchtitan, from any folder

from torchtitan.config.manager import parse_args  # noqa: E402
from torchtitan.estimation.dry_run import GiB, dry_run  # noqa: E402
from torchtitan.observability.logging import init_logger  # noqa: E402
from torchtitan.runtime import device_setup  # noqa: E402
from torchtitan.tools.runs import Runner, run_trainer  # noqa: E402


@dataclass(frozen=True)
class RankComparison:
    rank: int
    stages: tuple[int, ...]
    estimated: int  # bytes at the peak
    measured: int

    @property
    def error(self) -> float:
        """The estimate's relative error (positive: over-estimated)."""
        return self.estimated / self.measured - 1


@dataclass(frozen=True)
class Comparison:
    name: str
    nproc: int
    ranks: list[RankComparison]  # every rank the dry run simulated
    estimate_seconds: float

    @property
    def most_loaded(self) -> RankComparison:
        """The simulated rank that measured the most: the one a layout fits or fails by."""
        return max(self.ranks, key=lambda r: r.measured)

    @property
    def worst_error(self) -> float:
        return max((r.error for r in self.ranks), key=abs)

    def row(self) -> str:
        top = self.most_loaded
        return (f"| {self.name} | {self.nproc} | {top.rank} | {top.estimated / GiB:.3f} | {top.measured / GiB:.3f} | "
                f"{100 * top.error:+.2f}% | {100 * self.worst_error:+.2f}% ({len(self.ranks)} rank{'s' * (len(self.ranks) > 1)}) | "
                f"{self.estimate_seconds:.1f} |")


HEADER = ("| layout | ranks | most loaded rank | estimate GiB | measured GiB | error | worst error of the simulated "
          "ranks | estimate s |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")


def compare(name: str, args: Sequence[str], nproc: int, runner: Runner = run_trainer, timeout: float = 600) -> Comparison:
    """Estimates `args` (trainer options) as `nproc` ranks here, then measures them as a real job."""
    device = device_setup.device_type()
    common = [*args, "--job.dry_run", "--job.dry_run_device", device]
    estimate = dry_run(parse_args([*common, "--job.dry_run_world_size", str(nproc)]))
    result = runner([*common, "--memory_estimation.disable_fake_mode"], nproc, timeout=timeout)
    line = next(text for text in result.stdout.splitlines() if "MEASURED " in text)
    measured = json.loads(line.split("MEASURED ", 1)[1])
    ranks = [RankComparison(r.rank, r.stages, r.memory.peak, measured[r.rank]["memory"]["peak_bytes"])
             for r in estimate.ranks]
    return Comparison(name, nproc, ranks, sum(r.seconds for r in estimate.ranks))


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
