"""The product runner (torchtitan/tools/runs.py) without training: the command lines users' runs
get, the environment, and a failed run's error. Its torchrun path is exercised end to end by
scripts/loss_compare.py; the suite's own runs fork from the warm launcher (tests/machinery/)."""

import signal
import subprocess
import sys

import pytest

from torchtitan.tools import runs
from torchtitan.tools.runs import TrainingFailed, raise_for_exit, trainer_command, trainer_env


def test_one_process_is_the_trainer_and_several_ranks_are_torchrun_through_our_launcher():
    assert trainer_command(["--a", "1"]) == [sys.executable, "-m", "torchtitan.train", "--a", "1"]
    assert trainer_command(["--a", "1"], nproc=4) == [sys.executable, "-m", "torchtitan.runtime.launch", "--standalone",
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



def test_a_run_past_its_timeout_is_stopped_then_killed(monkeypatch):
    """The run ignores the polite stop (as a hung rank can), so it is killed after the grace period;
    the caller gets the timeout and no process is left."""
    started = []

    class IgnoresSigterm(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            before = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited: ignored in the child from its start
            try:
                super().__init__(*args, **kwargs)
            finally:
                signal.signal(signal.SIGTERM, before)
            started.append(self)

    monkeypatch.setattr(runs, "trainer_command", lambda args, nproc=1: ["sleep", "30"])
    monkeypatch.setattr(runs.subprocess, "Popen", IgnoresSigterm)
    monkeypatch.setattr(runs, "STOP_GRACE_SECONDS", 0.2)
    with pytest.raises(subprocess.TimeoutExpired):
        runs.run_trainer([], timeout=0.3)
    (proc,) = started
    assert proc.returncode == -signal.SIGKILL


def test_stopping_a_run_that_already_ended_is_quiet():
    proc = subprocess.Popen(["true"], start_new_session=True, stdout=subprocess.PIPE, text=True)
    proc.wait()  # reaped: its process group no longer exists
    runs._stop(proc)
    assert proc.returncode == 0
