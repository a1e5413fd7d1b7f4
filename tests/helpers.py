"""Helpers for tests that run the trainer as real processes (one process or torchrun ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# The debug model on short sequences: real text, real tokenizer, seconds per run on a CPU.
TINY_RUN = [
    "--job.config_file", "train_configs/debug_model.toml",
    "--training.seq_len", "64",
    "--training.steps", "10",
    "--training.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--metrics.disable_color_printing",
]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_train(args: list[str], nproc: int = 1, timeout: int = 300, check: bool = True,
              extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs `torchtitan.train` in one plain process (nproc=1) or under torchrun with nproc ranks."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "torchtitan.train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "torchtitan.train", *args]
    env = {**_env(), **(extra_env or {})}
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"training failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def read_metrics(dump_folder: Path) -> list[dict]:
    """The per-step records rank 0 wrote to dump_folder/metrics.jsonl."""
    with open(Path(dump_folder) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def losses(dump_folder: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(dump_folder)]
