"""The product runner (torchtitan/tools/runs.py) without training: the command lines users' runs
get, the environment, and a failed run's error. Its torchrun path is exercised end to end by
scripts/loss_compare.py; the suite's own runs fork from the warm launcher (tests/machinery/)."""

import subprocess
import sys

import pytest

from torchtitan.tools.runs import TrainingFailed, raise_for_exit, trainer_command, trainer_env


def test_one_process_is_the_trainer_and_several_ranks_are_torchrun_through_our_launcher():
    assert trainer_command(["--a", "1"]) == [sys.executable, "-m", "torchtitan.train", "--a", "1"]
    assert trainer_command(["--a", "1"], nproc=4) == [sys.executable, "-m", "torchtitan.launch", "--standalone",
                                                      "--nproc_per_node=4", "-m", "torchtitan.train", "--a", "1"]


def test_an_outer_torchrun_is_left_out_and_one_thread_is_the_default(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_PORT", "29500")
    env = trainer_env()
    assert "RANK" not in env and "MASTER_PORT" not in env and env["OMP_NUM_THREADS"] == "1"
    assert trainer_env({"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"


def test_a_failed_run_raises_with_its_output():
    failed = subprocess.CompletedProcess(["python", "-m", "torchtitan.train"], 2, "out tail", "error: bad option")
    with pytest.raises(TrainingFailed, match=r"training failed \(2\): python -m torchtitan.train\nout tail\nerror: bad"):
        raise_for_exit(failed)
    ok = subprocess.CompletedProcess([], 0, "", "")
    assert raise_for_exit(ok) is ok

