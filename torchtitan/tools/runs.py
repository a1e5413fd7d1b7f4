"""Runs the trainer as real processes, the way users start it, for the parity tool and the scripts.

One process is `python -m torchtitan.train`; several ranks are torchrun through our launcher,
`python -m torchtitan.runtime.launch --standalone --nproc_per_node N -m torchtitan.train` (what
run_llama_train.sh runs), which ends with the root cause in one line. Whatever takes a `Runner`
(the parity harness, the scripts' measurements) trains through `run_trainer` unless given another:
the test suite passes a faster one that forks runs from a warm process (tests/machinery/).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

# Variables of an outer torchrun that would confuse the inner launch.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID")
# A run that outlives its timeout is stopped like Ctrl-C first (torchrun passes the signal on and
# kills ranks still running after TORCH_ELASTIC_SHUTDOWN_TIMEOUT), then killed.
STOP_GRACE_SECONDS = 60
_RANKS_SHUTDOWN_SECONDS = "30"


class TrainingFailed(AssertionError):
    """The trainer exited non-zero; the message carries the end of its output."""


class Runner(Protocol):
    """Trains once with trainer options `args` on `nproc` ranks and returns the exit code and the
    captured text output; raises TrainingFailed on a non-zero exit when `check` is set, and
    subprocess.TimeoutExpired after `timeout` seconds. `run_trainer` is the product's."""

    def __call__(self, args: Sequence[str], nproc: int = 1, *, timeout: float | None = 300, check: bool = True,
                 extra_env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]: ...


def trainer_env(extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without an outer torchrun's variables, one thread per rank
    unless `extra_env` says otherwise."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update({"OMP_NUM_THREADS": "1", **(extra_env or {})})
    return env


def raise_for_exit(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    """`result` itself when the run exited 0, else TrainingFailed with the end of its output."""
    if result.returncode != 0:
        command = " ".join(map(str, result.args))
        raise TrainingFailed(f"training failed ({result.returncode}): {command}\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def trainer_command(args: Sequence[str], nproc: int = 1) -> list[str]:
    """The command line that trains with `args` on `nproc` ranks of this machine."""
    if nproc == 1:
        return [sys.executable, "-m", "torchtitan.train", *args]
    return [sys.executable, "-m", "torchtitan.runtime.launch", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "torchtitan.train", *args]


def run_trainer(args: Sequence[str], nproc: int = 1, *, timeout: float | None = 300, check: bool = True,
                extra_env: Mapping[str, str] | None = None,
                cwd: str | Path | None = None) -> subprocess.CompletedProcess[str]:
    """Runs `trainer_command(args, nproc)` in `cwd` (None: the current directory, against which
    relative paths in `args` resolve) and captures its output. A `Runner`."""
    cmd = trainer_command(args, nproc)
    env = trainer_env(extra_env)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", _RANKS_SHUTDOWN_SECONDS)
    # Its own process group, so that stopping it reaches the launcher and a single process's helpers.
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:  # a timeout, or Ctrl-C in this process: the run must not outlive the caller
        _stop(proc)
        raise
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    return raise_for_exit(result) if check else result


def _stop(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.communicate(timeout=STOP_GRACE_SECONDS)
            return
        except subprocess.TimeoutExpired:
            pass


def _read_jsonl(dump_folder: Path) -> list[dict]:
    with open(Path(dump_folder) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def read_metrics(dump_folder: Path) -> list[dict]:
    """The per-step rows rank 0 wrote to dump_folder/metrics.jsonl (not the setup records)."""
    return [row for row in _read_jsonl(dump_folder) if "record" not in row]


def read_validations(dump_folder: Path) -> list[dict]:
    """The validation rows (loss and perplexity of each validation run, by step) in metrics.jsonl."""
    return [row for row in _read_jsonl(dump_folder) if row.get("record") == "validation"]


def read_setup(dump_folder: Path) -> dict | None:
    """The newest setup record in dump_folder/metrics.jsonl (the latest run's: what it applied and
    loaded, torchtitan/observability/setup_record.py), or None if no run wrote one."""
    setups = [row for row in _read_jsonl(dump_folder) if row.get("record") == "setup"]
    return setups[-1] if setups else None
