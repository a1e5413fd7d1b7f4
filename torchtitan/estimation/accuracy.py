"""The dry run's estimate of a layout against what real ranks measure with the same tracker.

The estimate runs here, in this process, on fake tensors (dry_run.dry_run); the measurement runs
the same layout as a real job of `nproc` processes (gloo on the CPU, or GPUs), each rank measuring
its own second step (`--memory_estimation.disable_fake_mode`), and rank 0 printing every rank's
figures on a `MEASURED <json>` line. Both sides stand for the same device (`--job.dry_run_device`
set to the one the real job runs on), so they differ only where fake and real execution do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from torchtitan.config_manager import parse_args
from torchtitan.estimation.dry_run import GiB, dry_run
from torchtitan.parallelisms import distributed as tt_dist
from torchtitan.tools.runs import Runner, run_trainer


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
    device = tt_dist.device_type()
    common = [*args, "--job.dry_run", "--job.dry_run_device", device]
    estimate = dry_run(parse_args([*common, "--job.dry_run_world_size", str(nproc)]))
    result = runner([*common, "--memory_estimation.disable_fake_mode"], nproc, timeout=timeout)
    line = next(text for text in result.stdout.splitlines() if "MEASURED " in text)
    measured = json.loads(line.split("MEASURED ", 1)[1])
    ranks = [RankComparison(r.rank, r.stages, r.memory.peak, measured[r.rank]["memory"]["peak_bytes"])
             for r in estimate.ranks]
    return Comparison(name, nproc, ranks, sum(r.seconds for r in estimate.ranks))
