"""scripts/loss_compare.py: the parity harness from the command line prints one row per layout and
fails (exit 1) when a layout is outside the tolerance.

A bad name runs the script as a process, as users start it. The tables that train call its
`main` / `run_matrix` in this process with the suite's warm runner, which forks each run; the
script's default, real processes and torchrun (torchtitan.tools.runs), is what users run."""

import os
import subprocess
import sys

import pytest

from scripts import loss_compare
from tests.helpers import REPO_ROOT
from tests.machinery.fake_runner import FakeRunner
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
    from tests.machinery import layout_matrix

    assert all(f"matrix {p.name} " in listed for p in layout_matrix.generate())  # the generated points too
    bad = run_script("--layout", "nope")
    assert bad.returncode != 0 and "unknown layout 'nope'" in bad.stderr


def test_matrix_table_shows_refusals_and_fails_an_unplanned_outcome(tmp_path, capsys):
    """The matrix part of the script: a refused point's row carries its one-line reason; a point
    whose outcome differs from the plan (here: planned as refused, but it trains) counts as failed."""
    from tests.machinery import layout_matrix as lm

    refused = next(p for p in lm.generate() if p.refused_by_design)
    plain = lm.make_point({}, dp_shard=1)
    mislabelled = lm.Point(plain.degrees, plain.variants, plain.schedule, refused_by_design=True)
    assert loss_compare.run_matrix([refused, mislabelled], tmp_path, steps=2, runner=run_warm) == 1
    rows = table_rows(capsys.readouterr().out)
    assert f"refused: {lm.refusal(refused)}" in rows[refused.name]
    assert rows["single"].rstrip().endswith("| FAIL (trained, but planned to be refused) |")


# Bad input and failed runs, in this process with a runner that trains nothing (tests/machinery/fake_runner.py).


@pytest.mark.fast
def test_no_layout_chosen_is_an_error_before_any_run():
    runner = FakeRunner()
    with pytest.raises(SystemExit, match=r"^error: choose layouts with --suite, --layout or --custom \(see --list\)$"):
        loss_compare.main(["--steps", "2"], runner=runner)
    assert runner.calls == []


@pytest.mark.fast
def test_plot_without_matplotlib_is_an_error_before_any_run(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: importing it raises ImportError
    runner = FakeRunner()
    with pytest.raises(SystemExit, match=r"^error: --plot needs matplotlib: \.venv/bin/pip install -e '\.\[plot\]'$"):
        loss_compare.main(["--custom", "one", "1", "", "--plot", str(tmp_path / "loss.png")], runner=runner)
    assert runner.calls == [] and not (tmp_path / "loss.png").exists()


@pytest.mark.fast
def test_a_layout_that_does_not_fit_or_whose_run_fails_is_a_failed_row_and_the_others_still_run(tmp_path, capsys):
    """Three ranks cannot split the global batch of 8 (a config error); a crashed run and a run that
    did not start from the seed checkpoint are failed runs; the layout after them is still compared."""
    runner = FakeRunner(change={"unseeded": lambda rows: rows[1:]}, fail=["crashed"])
    code = loss_compare.main(["--steps", "3", "--workdir", str(tmp_path), "--custom", "odd", "3", "",
                              "--custom", "crashed", "2", "--training.data_parallel_shard_degree 2",
                              "--custom", "unseeded", "2", "--training.data_parallel_shard_degree 2",
                              "--custom", "fsdp2", "2", "--training.data_parallel_shard_degree 2"], runner=runner)
    out, err = capsys.readouterr()
    assert code == 1
    rows = table_rows(out)
    assert rows["odd"].rstrip().endswith("| config error |")
    assert rows["crashed"].rstrip().endswith("| run failed |") and rows["unseeded"].rstrip().endswith("| run failed |")
    assert rows["fsdp2"].rstrip().endswith("| ok |")
    assert "odd: global batch 8 does not divide by data-parallel degree x accumulation 3\n" in err
    assert "training failed (1): crashed\ncrashed: a rank crashed" in err
    assert "unseeded: the run did not start from the seed checkpoint" in err
