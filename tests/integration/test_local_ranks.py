"""tests/machinery/local_ranks.py, the forking stand-in for torchrun that tests use: ranks see the
usual environment, and a failing rank's exit code is the launcher's."""

import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT, TINY_RUN, run_train


@pytest.mark.fast
def test_usage_error():
    result = subprocess.run([sys.executable, "-m", "tests.machinery.local_ranks"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "usage:" in result.stderr


@pytest.mark.fast
def test_rank_failure_is_the_exit_code(tmp_path):
    # An unknown flavor is found on the ranks (after the mesh exists): every rank exits with 2.
    result = run_train([*TINY_RUN, "--job.dump_folder", str(tmp_path), "--model.flavor", "nope"], nproc=2, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("error: unknown model.flavor 'nope'") == 1  # every rank finds it; said once
