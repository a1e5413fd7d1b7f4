"""Running the trainer as real processes (one process, or torchrun ranks) from tests and scripts."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from torchtitan.tools.warm_launcher import WarmLauncher

REPO_ROOT = Path(__file__).resolve().parents[2]

# The debug model on short sequences: real text and tokenizer, a few seconds per run on a CPU.
TINY_RUN = (
    "--job.config_file", "train_configs/debug_model.toml",
    "--training.seq_len", "64",
    "--training.steps", "10",
    "--training.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--metrics.disable_color_printing",
)
# Variables of an outer torchrun that would confuse the inner launch.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID")


class TrainingFailed(AssertionError):
    """The trainer exited non-zero; the message carries the end of its output."""


def run_trainer(args: list[str] | tuple[str, ...], nproc: int = 1, timeout: float | None = 300, check: bool = True,
                extra_env: dict[str, str] | None = None, launcher: str = "warm") -> subprocess.CompletedProcess:
    """Runs `torchtitan.train` as one process (nproc=1) or as nproc gloo ranks, one thread per
    process unless extra_env says otherwise. launcher="warm" (the default) forks each run from a
    server that imported the trainer once (`torchtitan.tools.warm_launcher`); "process" starts a
    fresh interpreter (ranks forked by `torchtitan.tools.local_ranks`); "torchrun" uses torchrun."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update({"OMP_NUM_THREADS": "1", **(extra_env or {})})
    if launcher == "warm":
        result = _warm_launcher().run(nproc, list(args), env, timeout)
    else:
        result = _run_process(_command(args, nproc, launcher), env, timeout)
    if check and result.returncode != 0:
        raise TrainingFailed(f"training failed ({result.returncode}): {' '.join(args)}\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def _command(args: list[str] | tuple[str, ...], nproc: int, launcher: str) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "torchtitan.train", *args]
    if launcher == "process":
        return [sys.executable, "-m", "torchtitan.tools.local_ranks", str(nproc), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "torchtitan.train", *args]


def _run_process(cmd: list[str], env: dict[str, str], timeout: float | None) -> subprocess.CompletedProcess:
    # Its own session, so that a timeout takes every rank down, not only the launching process.
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


_WARM: list[WarmLauncher] = []  # this process's warm server, started on first use


def _warm_launcher() -> WarmLauncher:
    if not _WARM or not _WARM[0].alive():
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
        _WARM[:] = [WarmLauncher(REPO_ROOT, {**env, "OMP_NUM_THREADS": "1"})]
        atexit.register(_WARM[0].close)
    return _WARM[0]


def read_metrics(dump_folder: Path) -> list[dict]:
    """The per-step records rank 0 wrote to dump_folder/metrics.jsonl."""
    with open(Path(dump_folder) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]
