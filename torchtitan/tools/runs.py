"""Running the trainer as real processes (one process, or torchrun ranks) from tests and scripts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

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
                extra_env: dict[str, str] | None = None, launcher: str = "fork") -> subprocess.CompletedProcess:
    """Runs `torchtitan.train` in one plain process (nproc=1) or as nproc gloo ranks, one thread
    per process unless extra_env says otherwise. Ranks are forked from one warm process
    (`torchtitan.tools.local_ranks`, the fast default) or started by `torchrun` (launcher="torchrun")."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "torchtitan.train", *args]
    elif launcher == "fork":
        cmd = [sys.executable, "-m", "torchtitan.tools.local_ranks", str(nproc), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "torchtitan.train", *args]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update({"OMP_NUM_THREADS": "1", **(extra_env or {})})
    # Its own session, so that a timeout takes every rank down, not only the launching process.
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise TrainingFailed(f"training failed ({result.returncode}): {' '.join(args)}\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def read_metrics(dump_folder: Path) -> list[dict]:
    """The per-step records rank 0 wrote to dump_folder/metrics.jsonl."""
    with open(Path(dump_folder) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]
