"""scripts/loss_compare.py: the parity harness from the command line prints one row per layout and
fails (exit 1) when a layout is outside the tolerance."""

import os
import subprocess
import sys

from tests.helpers import REPO_ROOT


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/loss_compare.py", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_table_passes_an_equal_layout_and_fails_a_different_one(tmp_path):
    result = run_script("--steps", "3", "--workdir", str(tmp_path), "--layout", "ac_full",
                        "--custom", "higher_lr", "1", "--optimizer.lr 2e-3")
    assert result.returncode == 1, result.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in result.stdout.splitlines() if line.startswith("| ")}
    assert rows["ac_full"].rstrip().endswith("| ok |") and "| 0.00e+00 |" in rows["ac_full"]
    assert rows["higher_lr"].rstrip().endswith("| FAIL |")
    assert (tmp_path / "baseline" / "metrics.jsonl").exists() and (tmp_path / "seed" / "checkpoint" / "step-0").is_dir()


def test_list_and_bad_names():
    listed = run_script("--list")
    assert listed.returncode == 0 and "ddp2" in listed.stdout and "fsdp2_cpu_offload" in listed.stdout
    bad = run_script("--layout", "nope")
    assert bad.returncode != 0 and "unknown layout 'nope'" in bad.stderr
