"""scripts/loss_compare.py: the parity harness from the command line prints one row per layout and
fails (exit 1) when a layout is outside the tolerance.

A bad name runs the script as a process, as users start it. The tables that train call its
`main` / `run_matrix` in this process with the suite's warm runner, which forks each run; the
script's default, real processes and torchrun (torchtitan.tools.runs), is what users run."""

import os
import subprocess
import sys

from scripts import loss_compare
from tests.helpers import REPO_ROOT
from tests.machinery.warm_launcher import run_warm


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/loss_compare.py", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def table_rows(text: str) -> dict[str, str]:
    return {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}


def test_table_passes_an_equal_layout_and_fails_a_different_one(tmp_path, capsys):
    code = loss_compare.main(["--steps", "3", "--workdir", str(tmp_path), "--custom", "ac_full", "1",
                              "--activation_checkpoint.mode full", "--custom", "higher_lr", "1", "--optimizer.lr 2e-3"],
                             runner=run_warm)
    out, err = capsys.readouterr()
    assert code == 1, err[-3000:]
    rows = table_rows(out)
    assert rows["ac_full"].rstrip().endswith("| ok |") and "| 0.00e+00 |" in rows["ac_full"]
    assert rows["higher_lr"].rstrip().endswith("| FAIL |")
    assert (tmp_path / "baseline" / "metrics.jsonl").exists() and (tmp_path / "seed" / "checkpoint" / "step-0").is_dir()


def test_list_and_bad_names(capsys):
    assert loss_compare.main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert "fsdp2_cpu_offload" in listed
    assert "matrix rep2_fsdp2_cp2 " in listed  # the generated matrix's points are listed too
    bad = run_script("--layout", "nope")
    assert bad.returncode != 0 and "unknown layout 'nope'" in bad.stderr


def test_matrix_table_shows_refusals_and_fails_an_unplanned_outcome(tmp_path, capsys):
    """The matrix part of the script: a refused point's row carries its one-line reason; a point
    whose outcome differs from the plan (here: planned as refused, but it trains) counts as failed."""
    from torchtitan.tools import layout_matrix as lm

    refused = next(p for p in lm.generate() if p.refused_by_design)
    plain = lm._point({}, dp_shard=1)
    mislabelled = lm.Point(plain.degrees, plain.variants, plain.schedule, refused_by_design=True)
    assert loss_compare.run_matrix([refused, mislabelled], tmp_path, steps=2, runner=run_warm) == 1
    rows = table_rows(capsys.readouterr().out)
    assert f"refused: {lm.refusal(refused)}" in rows[refused.name]
    assert rows["single"].rstrip().endswith("| FAIL (trained, but planned to be refused) |")
