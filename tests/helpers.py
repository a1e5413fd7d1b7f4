"""Helpers for tests that run the trainer as real processes (one process or several ranks).

`run_train` is the suite's warm runner (tests/machinery/warm_launcher.py): each run forks from a
process that imported the trainer once. The tiny-run arguments are test machinery
(tests/machinery/tiny_run.py); the metrics readers come from torchtitan/tools/runs.py, the product
runner's module that the parity tool and the scripts use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.machinery.tiny_run import TINY_RUN as _TINY_RUN
from tests.machinery.warm_launcher import REPO_ROOT
from tests.machinery.warm_launcher import run_warm as run_train
from torchtitan.tools.runs import read_metrics, read_setup

__all__ = ["REPO_ROOT", "TINY_RUN", "losses", "read_metrics", "read_setup", "run_ranks_script", "run_train"]

# The tiny run on the smallest model (llama3 `tiny`: 2 blocks of width 128), a quarter of
# the debug model's cost per run; a test that needs depth or width asks for its flavor.
TINY_RUN = [*_TINY_RUN, "--model.flavor", "tiny"]


def losses(dump_folder: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(dump_folder)]


def run_ranks_script(script: str, nproc: int, folder: Path, *args: str, timeout: int = 180) -> dict:
    """Runs the Python source `script` on `nproc` gloo ranks under torchrun and returns the JSON
    object that one rank printed after "RESULT "."""
    path = Path(folder) / "ranks_script.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                             str(path), *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(text for text in result.stdout.splitlines() if "RESULT " in text)
    return json.loads(line.split("RESULT ", 1)[1])


def trainer_runs_on_the_warm_launcher(monkeypatch, module) -> None:
    """A script module's `run_trainer` (torchtitan.tools.runs: `python -m torchtitan.train`, 3 s of
    imports a run) replaced by the warm launcher's fork of the same trainer, in the repository root."""
    monkeypatch.setattr(module, "run_trainer", lambda args, timeout, check, extra_env, cwd:
                        run_train(args, timeout=timeout, check=check, extra_env=extra_env))


def passing_dry_report(main, tmp_path: Path, capsys, title: str) -> dict:
    """A GPU check's `--dry` run in-process (scripts/gpu_check.py, gpu_paths.py): it passes, says so
    first, and its report is returned."""
    out = tmp_path / "report.json"
    code = main(["--dry", "--out", str(out), "--work-dir", str(tmp_path / "work")])
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert code == 0 and report["ok"], json.dumps(report, indent=1)[-6000:]
    assert printed.startswith(f"{title}: all checks passed"), printed[:500]
    return report
