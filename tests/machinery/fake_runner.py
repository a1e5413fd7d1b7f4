"""A `Runner` (torchtitan/tools/runs.py) that trains nothing: it writes what the parity harness
reads of a run (the seed checkpoint's folder; metrics.jsonl with a setup record, one row per step
and the validation rows; checkpoint folders, from which a later run in the folder resumes; a
replica group's own folder), so that the verdicts of the harness and of its callers (the layout
matrix, scripts/loss_compare.py) on a bad run are tested in milliseconds."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from torchtitan.tools.runs import TrainingFailed

Rows = list[dict]


def _option(args: Sequence[str], name: str, default: str | None = None) -> str | None:
    """The last value given to `name` in `args` (later options win, as in the trainer)."""
    at = [i for i, a in enumerate(args) if a == name]
    return args[at[-1] + 1] if at else default


class FakeRunner:
    """Every run logs the same losses unless `change[name]` (name: the run's dump folder, e.g.
    "baseline" or a layout's name) edits its rows before they are written; runs named in `fail`
    exit 1 (TrainingFailed, as `run_trainer` raises with `check`). `calls` lists the folders run."""

    def __init__(self, change: Mapping[str, Callable[[Rows], Rows]] | None = None, fail: Sequence[str] = ()):
        self.change, self.fail, self.calls = dict(change or {}), set(fail), []

    def __call__(self, args: Sequence[str], nproc: int = 1, *, timeout: float | None = 300, check: bool = True,
                 extra_env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        folder = Path(_option(args, "--job.dump_folder"))
        if "--fault_tolerance.enable" in args:  # a replica group writes into a folder of its own
            folder = folder / f"replica_{_option(args, '--fault_tolerance.replica_id', '0')}"
        self.calls.append(folder.name)
        if folder.name in self.fail:
            result = subprocess.CompletedProcess(["fake", *args], 1, "", f"{folder.name}: a rank crashed")
            if check:
                raise TrainingFailed(f"training failed (1): {folder.name}\n{result.stderr}")
            return result
        if "--checkpoint.create_seed_checkpoint" in args:
            (folder / "checkpoint" / "step-0").mkdir(parents=True, exist_ok=True)
            return subprocess.CompletedProcess(["fake", *args], 0, "", "")
        steps = int(_option(args, "--training.steps", "10"))
        seed = _option(args, "--checkpoint.initial_load_path")
        saved = sorted(int(c.name.split("-")[1]) for c in (folder / "checkpoint").glob("step-*"))
        resumed = saved[-1] if saved and "--checkpoint.enable_checkpoint" in args else 0
        load = ({"path": str(folder / "checkpoint" / f"step-{resumed}"), "weights_only": False, "step": resumed}
                if resumed else None if seed is None else {"path": seed, "weights_only": True, "step": 0})
        rows: Rows = [{"record": "setup", "world_size": nproc, "initial_load": load}]
        rows += [{"step": s, "loss": 10.0 - s / 10, "grad_norm": 1.0 + s / 100} for s in range(resumed + 1, steps + 1)]
        rows += [{"record": "validation", "step": s, "loss": 9.0 - s / 10} for s in range(resumed + 1, steps + 1)
                 if s % 3 == 0 or s == steps]
        if folder.name in self.change:
            rows = self.change[folder.name](rows)
        folder.mkdir(parents=True, exist_ok=True)
        kept = [line for line in (folder / "metrics.jsonl").read_text().splitlines(keepends=True)
                if json.loads(line).get("step", 0) <= resumed and "record" not in json.loads(line)] if resumed else []
        (folder / "metrics.jsonl").write_text("".join(kept) + "".join(json.dumps(row) + "\n" for row in rows))
        if "--checkpoint.enable_checkpoint" in args:
            interval = int(_option(args, "--checkpoint.interval", "500"))
            for s in range(resumed + 1, steps + 1):
                if s % interval == 0 or s == steps:
                    (folder / "checkpoint" / f"step-{s}").mkdir(parents=True, exist_ok=True)
        return subprocess.CompletedProcess(["fake", *args], 0, "", "")
